"""coat_compare.plan: sizes on paper for layouts not run yet, checked against measured peaks."""

import pytest

from coat_compare import plan
from coat_compare.presets import get_preset


@pytest.mark.parametrize("anchor", plan.ANCHORS, ids=lambda a: f"{a.preset}-{a.layout}-mb{a.micro_batch}-{a.mode}")
def test_the_projection_meets_every_measured_eager_peak_within_3_percent(anchor):
    ((tp, pp, _, dp),) = plan.parse_layouts(anchor.layout)
    projected = plan.size(get_preset(anchor.preset), anchor.mode, tp, pp, dp).at(anchor.micro_batch) * 1024
    assert projected == pytest.approx(anchor.peak_mib, rel=0.03)


def test_sharding_splits_what_megatron_splits():
    preset = get_preset("llama2-13b")
    one, dp8, tp8 = (plan.size(preset, "coat", *layout) for layout in ((1, 1, 1), (1, 1, 8), (8, 1, 1)))
    # DP shards only the master weights and states; TP shards everything, activations too (SP)
    assert one.activation_gib_per_micro_batch == dp8.activation_gib_per_micro_batch
    assert tp8.activation_gib_per_micro_batch == pytest.approx(one.activation_gib_per_micro_batch / 8)
    assert tp8.static_gib == pytest.approx(one.static_gib / 8)
    assert tp8.static_gib < dp8.static_gib < one.static_gib
    # PP: a stage keeps pp micro-batches of its layers / pp layers in flight
    pp2 = plan.size(preset, "coat", 1, 2, 1)
    assert pp2.static_gib == pytest.approx(one.static_gib / 2)
    assert pp2.activation_gib_per_micro_batch == one.activation_gib_per_micro_batch


def test_the_largest_micro_batch_fills_the_gpu_and_no_more():
    s = plan.Size(static_gib=30.0, activation_gib_per_micro_batch=4.0)
    mb = s.largest_micro_batch(79.0)
    assert mb == 11 and s.at(mb) <= 79.0 - plan.OTHER_GIB < s.at(mb + 1)
    assert plan.Size(80.0, 1.0).largest_micro_batch(79.0) == 0


def test_the_table_names_what_cannot_split_and_bad_modes_fail_clearly(capsys):
    lines = plan.table(["llama-30b"], "tp8,tp4xpp2", ["coat"], 79.0)
    assert any("52 heads do not split over TP 8" in line for line in lines)
    assert any(line.startswith("| llama-30b | 32.5B | tp4xpp2 | coat |") for line in lines)
    with pytest.raises(SystemExit) as e:
        plan.main(["--modes", "coat-fp32"])
    assert (
        e.value.code == 2
        and "the plan has activation figures for bf16, te-fp8-current, coat only" in capsys.readouterr().err
    )
