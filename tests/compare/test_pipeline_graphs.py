"""Per-layer CUDA graphs under pipeline parallelism (``--cuda-graphs local`` with ``--pp``): the
implementation coat-compare picks, as ``coat-megatron-run --coat-fp8`` does (TE's where TE is
installed, else eager with the reason), and how its train loop drives TE's graphs; on a CPU, with
TransformerEngine absent and with a stub of it. The GPU check is docs/compare.md's; the check that
``pretrain()``'s graphed PP 2 + VPP 2 run trained like its eager self applies ``coat_compare.layouts``' rule
to the committed rows."""

import json
from types import SimpleNamespace

import pytest
from test_readme_figures import RESULTS, check_index

import coat_megatron.optional
from coat_compare import build, layouts, train
from coat_compare.modes import MODES
from coat_compare.presets import get_preset
from coat_compare.report import _graphs


@pytest.fixture
def te(monkeypatch):
    """Whether TransformerEngine is installed, as the test sets it (the stub: installed)."""

    def set_te(installed: bool) -> None:
        monkeypatch.setattr(coat_megatron.optional, "transformer_engine_available", lambda: installed)

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    return set_te


@pytest.mark.parametrize("installed", [False, True])
def test_without_pipeline_stages_each_configuration_is_megatrons_own(te, installed):
    te(installed)
    assert build.cuda_graph_impl("none", 1) == ("none", None) and build.cuda_graph_impl("none", 2) == ("none", None)
    assert build.cuda_graph_impl("local", 1) == ("local", None)
    assert build.cuda_graph_impl("full", 1) == ("full_iteration", None)


def test_per_layer_graphs_under_pipeline_stages_are_tes_where_it_is_installed(te):
    te(True)
    assert build.cuda_graph_impl("local", 2) == ("transformer_engine", None)
    config = build.transformer_config(get_preset("tiny"), MODES["coat"], 1, pp=2, vpp=2, graphs="local")
    assert (config.cuda_graph_impl, config.cuda_graph_warmup_steps) == ("transformer_engine", 1)
    assert build.transformer_config(get_preset("tiny"), MODES["coat"], 1, graphs="local").cuda_graph_impl == "local"


def test_without_transformer_engine_they_run_eagerly_with_one_line_saying_why(te):
    te(False)
    impl, why = build.cuda_graph_impl("local", 2)
    assert impl == "none" and "\n" not in why
    assert why.startswith("--cuda-graphs local under pipeline parallelism runs eagerly: ")
    assert "local per-layer graphs do not run with pipeline parallelism" in why and "need TransformerEngine" in why
    assert (
        build.transformer_config(get_preset("tiny"), MODES["bf16"], 1, pp=2, graphs="local").cuda_graph_impl == "none"
    )
    row = {"mode": "coat", "graphs": "local", "cuda_graph_impl": impl, "cuda_graph_note": why}
    assert (
        _graphs(row) == "local (eager)" and _graphs({**row, "cuda_graph_impl": "transformer_engine"}) == "local (TE's)"
    )
    assert _graphs({"graphs": "local", "cuda_graph_impl": "local"}) == "local" and _graphs({"mode": "x"}) == "none"


def test_an_allocator_that_te_graphs_cannot_run_with_keeps_them_eager(te, monkeypatch):
    te(True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    impl, why = build.cuda_graph_impl("local", 2)
    assert impl == "none" and "need NCCL_GRAPH_REGISTER=0 in the environment" in why
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert build.cuda_graph_impl("local", 2) == ("transformer_engine", None)


class Helper:
    """TECudaGraphHelper as the train loop uses it, recording the calls."""

    made = []

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=()):
        self.args, self.calls, self.finished = (model, seq_length, micro_batch_size, optimizers), [], False
        Helper.made.append(self)

    def capture_finished(self):
        return self.finished

    def create_cudagraphs(self):
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        self.calls.append(("capture", get_num_microbatches()))
        self.finished = True

    def cuda_graph_set_manual_hooks(self):
        self.calls.append("manual hooks")


class Chunk:
    def __init__(self, impl: str, calls: list):
        self.config, self.calls = SimpleNamespace(cuda_graph_impl=impl, cuda_graph_warmup_steps=1), calls

    def disable_forward_pre_hook(self, param_sync=True):
        self.calls.append(("hooks off", param_sync))

    def enable_forward_pre_hook(self):
        self.calls.append("hooks on")


@pytest.mark.parametrize("overlap_param_gather", [False, True])
def test_the_loop_captures_te_graphs_after_the_eager_warm_up_steps_as_megatron_training_does(
    monkeypatch, overlap_param_gather
):
    from megatron.core import num_microbatches_calculator
    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", Helper)
    preset, calls = get_preset("tiny"), []
    chunks = [Chunk("transformer_engine", calls), Chunk("transformer_engine", calls)]
    options = train.TrainOptions(dp=2, pp=2, vpp=2, overlap_param_gather=overlap_param_gather)
    optimizer = object()
    assert train.te_graphs([Chunk("local", calls)], optimizer, preset, 4, options) is None
    capture = train.te_graphs(chunks, optimizer, preset, 4, options)
    helper = Helper.made[-1]
    assert helper.args == (chunks, preset.seq, preset.micro_batch, [optimizer])
    capture(0)  # the first step runs eagerly
    assert helper.calls == [] and calls == []
    capture(1)
    hooks = [("hooks off", False), ("hooks off", False), "hooks on", "hooks on"] if overlap_param_gather else []
    assert helper.calls == [("capture", 4)] + (["manual hooks"] if overlap_param_gather else []) and calls == hooks
    capture(2)  # once
    assert len(helper.calls) == 1 + overlap_param_gather
    assert num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None  # left as it was


def test_layouts_holds_a_graphed_layout_to_its_eager_self(monkeypatch):
    from coat_compare import cli

    o = cli.parse_args(["layouts", "pp2", "--modes", "bf16,coat", "--cuda-graphs", "none,local", "--global-batch", "8"])
    assert o.trained_layouts == [(1, 2, 1, 1)]
    losses = {("bf16", "none"): [5.0, 4.0], ("bf16", "local"): [5.0, 4.01], ("coat", "none"): [5.0, 4.02],
              ("coat", "local"): [5.0, 4.03]}  # fmt: skip
    started = []

    def run_probe(line, processes, timeout_s=None):
        mode, graphs = line[line.index("--modes") + 1], line[line.index("--cuda-graphs") + 1]
        started.append((mode, graphs, processes, line[line.index("--pp") + 1]))
        return SimpleNamespace(row={"mode": mode, "graphs": graphs, "status": "ok", "losses": losses[(mode, graphs)]})

    monkeypatch.setattr(layouts, "new_row", lambda kind, preset, mode, o, graphs: {"mode": mode.name, "graphs": graphs})
    monkeypatch.setattr(layouts, "run_probe", run_probe)
    rows = []
    layouts.measure(o, rows.append)
    assert started == [(m, g, 2, "2") for m in ("bf16", "coat") for g in ("none", "local")]
    by = {(r["mode"], r["layout"]): r for r in rows}
    assert set(by) == {(m, f"pp2/{g}") for m in ("bf16", "coat") for g in ("none", "local")}
    graphed = by[("coat", "pp2/local")]
    assert (graphed["reference"], graphed["graphs"], graphed["agrees"]) == ("pp2/none", "local", True)
    assert graphed["bf16_drift"] == pytest.approx(0.01)  # BF16's own: graphed against eager
    with pytest.raises(SystemExit):  # one layout in one configuration compares nothing
        cli.parse_args(["layouts", "pp2", "--cuda-graphs", "local"])


def test_the_graphed_pipeline_with_virtual_stages_trains_like_eager_by_the_layout_rule():
    """pretrain() at PP 2 + VPP 2 (pretrain-pipeline-4gpu's rows): --coat-fp8's TE-based graphs against eager
    COAT, each logged loss, judged by coat_compare.layouts with BF16's own graphed-against-eager difference;
    docs/results.md quotes the judgement."""
    with open(RESULTS / "pretrain-pipeline-4gpu" / "rows.jsonl") as f:
        found = {(r["layout"], r["mode"]): r["losses"] for r in map(json.loads, f)}

    def series(mode):
        losses = found["pp2vp2", mode]
        return [losses[i] for i in sorted(losses, key=int)]

    bf16_drift = layouts.largest_difference(series("bf16-graphs"), series("bf16"))
    got = layouts.judge(series("coat"), series("coat-auto"), bf16_drift)
    assert got["agrees"], got
    check_index(
        "pretrain-pipeline-4gpu: per-layer graphs under PP",
        [
            f"at PP 2 + VPP 2 within {got['drift']:.4f} (BF16's graphs against eager: {bf16_drift:.4f}; "
            f"the layout rule's bound {got['drift_bound']:.2f})"
        ],
    )
