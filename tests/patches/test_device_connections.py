"""CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron-core 0.19 requires it, set by the launcher before CUDA starts."""

import os
import subprocess
import sys

import pytest
from megatron_argv import MOCK_MODEL

from coat_patches import device_connections
from coat_patches.device_connections import VARIABLE, megatron_requires_one_connection, set_device_max_connections

HOPPER, BLACKWELL = 9, 10


@pytest.mark.parametrize(
    "argv, major, required",
    [
        ([], HOPPER, False),
        (["--tensor-model-parallel-size", "2"], HOPPER, True),
        (["--tensor-model-parallel-size=2"], HOPPER, True),
        (["--context-parallel-size", "2"], HOPPER, True),
        (["--pipeline-model-parallel-size", "4"], HOPPER, False),
        (["--tensor-model-parallel-size", "2"], None, True),  # no NVML (a CPU run): Megatron's rules before Blackwell
        (["--tensor-model-parallel-size", "2"], BLACKWELL, False),
        (["--tensor-model-parallel-size", "2", "--use-megatron-fsdp"], HOPPER, False),  # Megatron refuses 1 there
        (["--tensor-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"], HOPPER, False),  # a warning
        (["--tensor-model-parallel-size", "two"], HOPPER, False),  # Megatron's parser reports the bad value
        (["--tensor-model-parallel"], HOPPER, False),  # no abbreviations, as Megatron's parser
    ],
)
def test_the_condition_is_megatrons(argv, major, required):
    assert megatron_requires_one_connection([*MOCK_MODEL, *argv], major) is required


@pytest.mark.parametrize(
    "user, tp, expected, notice",
    [
        (None, 2, "1", False),
        ("1", 2, "1", False),
        ("8", 2, "1", True),  # Megatron would refuse 8: replaced, and said
        ("8", 1, "8", False),  # nothing required: the user's value stays
        (None, 1, None, False),
    ],
)
def test_set_only_where_required_and_the_users_value_kept_unless_megatron_refuses_it(
    monkeypatch, user, tp, expected, notice
):
    monkeypatch.setattr(device_connections, "gpu_compute_capability_major", lambda: HOPPER)
    if user is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, user)
    said = set_device_max_connections([*MOCK_MODEL, "--tensor-model-parallel-size", str(tp)])
    assert os.environ.get(VARIABLE) == expected
    if notice:
        assert said == (
            f"{VARIABLE}=8 replaced by 1: Megatron requires 1 for tensor or context parallelism on GPUs before Blackwell"
        )
    else:
        assert said is None


SCRIPT = """
import os
print("at start:", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
from megatron.training.arguments import parse_and_validate_args
args = parse_and_validate_args()
print("validated: tensor parallel", args.tensor_model_parallel_size, flush=True)
"""


@pytest.mark.parametrize("tp, expected", [(2, "1"), (1, "8")])
def test_the_launcher_sets_it_before_the_script_starts(tmp_path, tp, expected):
    """Through coat-megatron-run as a process, with CUDA_DEVICE_MAX_CONNECTIONS=8 set by the user:
    at TP 2 Megatron's validate_args (which on a CPU applies the rules before Blackwell) would refuse
    8; the script sees 1 from its first line on and validates. At TP 1 the user's 8 stays."""
    script = tmp_path / "validate_only.py"
    script.write_text(SCRIPT)
    environment = {
        **os.environ,
        VARIABLE: "8",
        **dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT="29598"),
    }
    command = [sys.executable, "-m", "coat_patches.launch", "--cpu", str(script), *MOCK_MODEL]
    command += ["--tensor-model-parallel-size", str(tp)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at start: {expected}\n" in done.stdout
    assert f"validated: tensor parallel {tp}\n" in done.stdout
    assert ("replaced by 1" in done.stdout) is (tp == 2)
