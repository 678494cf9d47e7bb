"""A hand-edited plan file: each mistake is one line naming the field and the fix."""

import json

import pytest

from hetrain.errors import HetrainError
from hetrain.planning.plan import Plan


def _doc(**rank) -> str:
    return json.dumps({"global_batch_size": 8, "ranks": [{"rank": 0, "share": 8, **rank}]})


def test_a_misspelt_field_names_the_spelling_to_use():
    """Raw pydantic text ('ranks.0.share: Field required; ranks.0.shrae: Extra inputs are not permitted')
    gave no fix, where the cluster file's loader names one."""
    doc = json.loads(_doc())
    doc["ranks"][0]["shrae"] = doc["ranks"][0].pop("share")
    with pytest.raises(HetrainError, match=r"^plan: ranks\.0\.shrae: unknown field; fix: rename it to 'share'$"):
        Plan.from_json(json.dumps(doc))
    with pytest.raises(HetrainError, match=r"ranks\.0\.micro_bach: unknown field; fix: rename it to 'micro_batch'"):
        Plan.from_json(_doc(micro_bach=2))   # an optional field: matched against the plan's field names
    with pytest.raises(HetrainError, match=r"ranks\.0\.zzz: unknown field; fix: remove it or correct its name"):
        Plan.from_json(_doc(zzz=1))
    # a rank's field at the top level is not told to rename itself to itself; an unrelated field beside a
    # missing one is not told to become it
    with pytest.raises(HetrainError, match=r"^plan: micro_batch: unknown field; fix: remove it or correct its name$"):
        Plan.from_json(json.dumps({**json.loads(_doc()), "micro_batch": 2}))
    doc = json.loads(_doc())
    doc["ranks"][0]["comment"] = doc["ranks"][0].pop("share")
    with pytest.raises(HetrainError, match=r"ranks\.0\.share: Field required; ranks\.0\.comment: unknown field; "
                                           r"fix: remove it"):
        Plan.from_json(json.dumps(doc))
    with pytest.raises(HetrainError, match=r"pipeline\.microbatch: unknown field; fix: rename it to 'microbatches'"):
        Plan.from_json(json.dumps({**json.loads(_doc()), "pipeline": {"stages": [[0, 1]], "microbatch": 2}}))


def test_memory_and_precision_a_device_cannot_have_are_refused():
    """A negative capacity passed, and the job stopped after start-up naming sharding 'fsdp' as the fix;
    bf16 on a V100 entry passed as well."""
    with pytest.raises(HetrainError, match="memory_capacity_bytes: Input should be greater than 0"):
        Plan.from_json(_doc(memory_capacity_bytes=-5))
    with pytest.raises(HetrainError, match="memory_bytes: Input should be greater than or equal to 0"):
        Plan.from_json(_doc(memory_bytes=-1))
    with pytest.raises(HetrainError, match="precision bf16 on v100-sxm2-32gb, which has no bf16: use fp16"):
        Plan.from_json(_doc(device="v100-sxm2-32gb", precision="bf16"))
    assert Plan.from_json(_doc(device="a100-sxm4-80gb", precision="bf16")).ranks[0].precision == "bf16"
