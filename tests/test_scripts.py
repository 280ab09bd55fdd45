"""The GPU scripts parse (``bash -n``), and every part a script's header names has its branch in
the script's ``case`` and the other way round: a device command names a part, and a dropped branch
would only show on the GPU, as "unknown part", after the machine's set-up time was spent."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "scripts").glob("gpu_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_documented_part_has_a_branch_and_every_branch_is_documented():
    script = Path(__file__).parent.parent / "scripts" / "gpu_default.sh"
    text = script.read_text()
    documented = set(re.findall(r"^#\s+(?:\S+=\S+ )*bash scripts/gpu_default\.sh ([a-z0-9-]+)", text, re.M))
    branches = set(re.findall(r"^  ([a-z0-9-]+)\)$", text, re.M))
    assert documented == branches, documented ^ branches
    unknown = re.search(r'unknown part \$part: ([^"]+)"', text).group(1)
    listed = set(re.findall(r"[a-z0-9-]+", unknown.replace(" or ", ", "))) - {"or"}
    assert listed == branches, listed ^ branches
