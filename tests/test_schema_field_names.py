"""pydantic before 2.10 (the floor pyproject.toml allows) warns at import of any schema with a field named
`model_...` unless the schema frees that namespace: a warning on every `hetrain plan`, and an import error under
`-W error`. Every hetrain schema with such a field frees it."""

import importlib
import pkgutil

from pydantic import BaseModel

import hetrain


def _schemas() -> list[type[BaseModel]]:
    found = []
    for info in pkgutil.walk_packages(hetrain.__path__, "hetrain."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == info.name:
                found.append(value)
    return found


def test_every_schema_with_a_model_field_frees_the_namespace_older_pydantic_protects():
    schemas = _schemas()
    assert len(schemas) > 10   # the walk found hetrain's schemas
    offending = []
    for cls in schemas:
        for name in cls.model_fields:
            protected = cls.model_config.get("protected_namespaces", ("model_",))   # the floor's default
            if any(name.startswith(prefix) for prefix in protected if isinstance(prefix, str)) or (
                    name.startswith("model_") and "protected_namespaces" not in cls.model_config):
                offending.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert not offending, offending
