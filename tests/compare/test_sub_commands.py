"""coat-compare's sub-commands: each has its own --help with its own options, a command line without
one is ``run``'s (the accuracy runner's command lines among them, flag for flag), and the job's
``Options`` are built once, by ``cli.parse_args``, and handed to the sub-command whole."""

import os
import subprocess
import sys

import pytest

from coat_compare import cli, job
from coat_compare import protocol as P


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


OWN = {  # options only that sub-command takes
    "run": ["--save DIR", "--load DIR", "--checkpoint-format"],
    "search": ["--search-steps", "--fit-memory"],
    "resume": ["--resume-at", "--checkpoint-dir"],
    "layouts": ["LAYOUTS"],
    "summarize": ["--out"],
}


@pytest.mark.parametrize("command", list(cli.SUB_COMMANDS))
def test_each_sub_command_has_its_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        job.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    if command == "protocol":  # its own parser: coat_compare.protocol
        assert "{show,flags,run,power,judge,keep}" in text
        return
    assert text.startswith(f"usage: coat-compare {command} ") and cli.SUB_COMMANDS[command] in " ".join(text.split())
    for option in OWN[command]:
        assert option in text, (command, option)
    for other, options in OWN.items():
        if other != command and other != "summarize":
            assert not any(o in text for o in options if o != "--out"), (command, other)
    assert "--probe" not in text  # the job's own runs use it


def test_the_top_help_lists_every_sub_command():
    proc = subprocess.run([sys.executable, "-m", "coat_compare", "--help"], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split("SUB-COMMAND", 2)[-1]
    assert all(f"    {command} " in listed for command in cli.SUB_COMMANDS), listed
    assert "Without a sub-command the command line is ``run``'s" in proc.stdout


def test_a_command_line_without_a_sub_command_is_runs():
    flat = ["--preset", "gpt-125m", "--micro-batch", "4", "--modes", "coat", "--seed", "3", "--steps", "40"]
    assert cli.parse_args(flat) == cli.parse_args(["run", *flat])
    o = cli.parse_args(flat)
    assert (o.command, o.preset.name, o.preset.micro_batch, [m.name for m in o.modes], o.seed) == (
        "run", "gpt-125m", 4, ["coat"], 3,
    )  # fmt: skip
    assert cli.parse_args([]).command == "run" and cli.parse_args([]).preset.name == "tiny"


@pytest.mark.parametrize("name", list(P.PROTOCOLS))
def test_the_accuracy_runners_command_lines_parse_as_run_flag_for_flag(name, tmp_path):
    """The runner (coat_compare.protocol.runner) starts ``coat-compare FLAGS --out --name --no-plots``:
    each of its flags keeps its name and meaning."""
    protocol = P.get_protocol(name)
    for segment in protocol.segments():
        checkpoint = None if segment == "full" else str(tmp_path / "trunk")
        if segment in ("main", "branch"):
            continue  # they load the trunk's checkpoint, which is checked on disk before any work
        argv = P.flags(protocol, 1, "coat@run2", segment, checkpoint)
        o = cli.parse_args([*argv, "--out", str(tmp_path / "out"), "--name", "x", "--no-plots"])
        assert o.command == "run" and o.preset.name == protocol.preset and [m.name for m in o.modes] == ["coat"]
        assert (o.seed, o.repeat, o.cuda_graphs, o.no_plots) == (1, 2, protocol.graphs.split(","), True)
        for option, value in P.segment_settings(protocol, segment).items():
            field = option.lstrip("-").replace("-", "_")
            assert str(getattr(o, field)) == str(value), option
        if segment == "trunk":
            assert (o.save, o.save_step, o.stop_after_save) == (checkpoint, protocol.branch[0], True)


def test_the_options_are_built_once_and_handed_to_the_sub_command_whole(monkeypatch, tmp_path):
    built, given = [], []

    class Counted(cli.Options):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(cli, "Options", Counted)
    for command in ("run", "search", "resume", "layouts", "summarize"):
        monkeypatch.setitem(job.SUB_COMMANDS, command, lambda o: given.append(o) or 0)
    out = ["--out", str(tmp_path)]
    for argv in (["--modes", "coat", *out], ["search", *out], ["resume", "--dp", "2", *out],
                 ["layouts", "1,dp2", "--global-batch", "16", *out], ["summarize", *out]):  # fmt: skip
        built.clear()
        given.clear()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        assert job.main(argv) == 0
        assert len(built) == 1 and len(given) == 1 and given[0] is built[0], argv  # one object, the one parsed
        assert given[0].command == (argv[0] if argv[0] in cli.SUB_COMMANDS else "run")


def test_protocol_hands_its_command_line_to_the_protocols(capsys):
    assert job.main(["protocol", "show", "gpt-125m-wsd"]) == 0
    assert "gpt-125m-wsd" in capsys.readouterr().out
