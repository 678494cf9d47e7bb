"""`hetrain <verb>`: each verb lives in its own module, imported only when it runs.

A verb module defines `build_parser(parser)` (adds its arguments) and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from hetrain.errors import HetrainError
from hetrain.exiting import collect_then_freeze, once_at_exit

# verb -> (module, one-line help). The order here is the order of `hetrain --help`.
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("hetrain.cli.demo", "train on 2 emulated mixed devices: plain DDP against hetrain"),
    "devices": ("hetrain.cli.devices", "the GPU catalog and the devices on this machine"),
    "profile": ("hetrain.cli.profile", "time a model on this machine's devices: one profile per device kind"),
    "plan": ("hetrain.cli.plan", "choose per-device shares, precision and memory strategy"),
    "simulate": ("hetrain.cli.simulate", "sweep cluster sizes or mixes and plot predicted speed"),
    "launch": ("hetrain.cli.launch", "run a training script on torch's elastic agent"),
    "report": ("hetrain.cli.report", "a PNG and a table of a run's per-rank figures from its run log"),
    "dashboard": ("hetrain.cli.dashboard", "the Grafana dashboard JSON for hetrain's Prometheus series"),
    "bench": ("hetrain.cli.bench", "benchmarks that print ratios measured in one run"),
    "k8s": ("hetrain.cli.k8s", "write a Kubernetes manifest for an elastic PyTorchJob"),
}


class OneLineParser(argparse.ArgumentParser):
    """A verb's parser whose errors are one line naming the fix (argparse prints its whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {verb:<10} {text}" for verb, (_, text) in VERBS.items())
    parser = argparse.ArgumentParser(
        prog="hetrain",
        description="Train one PyTorch model across GPUs that are not alike.",
        epilog=f"verbs:\n{lines}\n\n`hetrain VERB --help` for each verb's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # only printed: main() answers -V/--version itself, without parsing
    parser.add_argument("-V", "--version", action="store_true", help="print hetrain's version and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from hetrain import __version__

        print(f"hetrain {__version__}")
        return 0
    verb = argv[0]
    if verb not in VERBS:
        print(f"hetrain: error: unknown verb {verb!r}; choose one of: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module_name, text = VERBS[verb]
    once_at_exit(collect_then_freeze)   # the verb's torch is not walked again at exit
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"hetrain {verb}: error: this verb is not part of this build", file=sys.stderr)
            return 2
        raise
    parser = OneLineParser(prog=f"hetrain {verb}", description=text)
    module.build_parser(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except HetrainError as e:
        print(f"hetrain {verb}: error: {e}", file=sys.stderr)
        return int(getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        print(f"hetrain {verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `hetrain devices --json | head`: the reader had enough; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    # Safety nets: a file or value a verb did not check itself still ends as one line, not a traceback.
    except OSError as e:
        if e.filename is None:
            raise
        print(f"hetrain {verb}: error: {_os_error_line(e)}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"hetrain {verb}: error: an input file is not UTF-8 text ({e.reason} at byte {e.start}); "
              "fix: give the JSON or YAML file hetrain wrote, not a binary file", file=sys.stderr)
        return 2
    except ValueError as e:
        from pydantic import ValidationError

        if not isinstance(e, ValidationError):
            raise
        print(f"hetrain {verb}: error: {_validation_line(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"hetrain {verb}: error: ran out of memory; fix: check the sizes and counts given "
              "(hetrain plans at most 65,536 devices)", file=sys.stderr)
        return 2


def _os_error_line(e: OSError) -> str:
    """A file the system refused, as one line: which file, why, and the fix."""
    what = f"{e.filename!r}" + (f" -> {e.filename2!r}" if e.filename2 else "")
    return f"{what}: {e.strerror or e}; fix: check the path, that its directory exists and can be written"


def _validation_line(e: ValueError) -> str:
    """A pydantic ValidationError that reached the CLI (a value given on the command line) as one line."""
    err = e.errors()[0]  # type: ignore[attr-defined]
    where = ".".join(str(p) for p in err["loc"]) or e.title  # type: ignore[attr-defined]
    count = e.error_count()  # type: ignore[attr-defined]
    more = f" (and {count - 1} more)" if count > 1 else ""
    return f"{where}: {err['msg']}, got {err.get('input')!r}{more}; fix: correct that value"


if __name__ == "__main__":
    sys.exit(main())

