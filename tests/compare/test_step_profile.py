"""benchmarks/step_profile.py's accounting of a step's GPU time: kernel classes, exposed collectives."""

import pytest

from tests.load_file import load_file

step_profile = load_file("benchmarks/step_profile.py", "step_profile")


def test_kernel_classes_put_collectives_and_the_optimizer_apart():
    cls = step_profile.step_kernel_class
    assert cls("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collectives (NCCL)"
    assert cls("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "collectives (NCCL)"
    assert cls("_fp8_adamw_kernel") == "optimizer"
    assert cls("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>") == "optimizer"
    assert cls("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert cls("_quantize_per_tensor_kernel") == "quantize / cast / transpose"
    assert cls("_norm_quantize_kernel") == "norm"
    assert cls("flash_fwd_kernel") == "attention"
    assert cls("something_unnamed") == "other"


def test_class_times_sum_per_step_and_count_only_unoverlapped_collectives():
    kernels = [  # (name, start us, end us) over 2 steps
        ("nvjet_gemm", 0.0, 1000.0),
        ("ncclDevKernel_AllGather", 500.0, 1500.0),  # 500 us under the GEMM, 500 us alone
        ("_quantize_per_tensor_kernel", 2000.0, 2400.0),
        ("ncclDevKernel_ReduceScatter", 3000.0, 3600.0),  # alone
        ("ncclDevKernel_AllGather", 3100.0, 3200.0),  # inside the one above: no extra exposed time
    ]
    got = step_profile.class_times(kernels, steps=2)
    assert got["class_ms_per_step"] == pytest.approx(
        {"GEMM": 0.5, "collectives (NCCL)": 0.85, "quantize / cast / transpose": 0.2}
    )
    assert list(got["class_ms_per_step"])[0] == "collectives (NCCL)"  # largest first
    assert got["exposed_collective_ms_per_step"] == pytest.approx((500 + 600) / 1e3 / 2)
    assert got["compute_busy_ms_per_step"] == pytest.approx((1000 + 400) / 1e3 / 2)


def test_class_table_has_a_row_per_mode_and_the_host_share():
    rows = [
        {
            "mode": m,
            "graphs": "local",
            "wall_ms_per_step": 10.0,
            "gpu_busy_ms_per_step": b,
            "class_ms_per_step": c,
            "exposed_collective_ms_per_step": 1.0,
            "compute_busy_ms_per_step": b - 1,
        }
        for m, b, c in (("bf16", 9.0, {"GEMM": 6.0}), ("coat", 8.0, {"GEMM": 4.0, "norm": 2.0}))
    ]
    lines = step_profile.class_table(rows)
    header = next(line for line in lines if line.startswith("| mode"))
    assert header.split(" | ")[2:4] == ["GEMM", "norm"]
    coat = next(line for line in lines if line.startswith("| coat"))
    assert [c.strip() for c in coat.strip("|").split("|")] == ["coat", "local", "4.0", "2.0", "1.0", "7.0", "2.0"]


def test_a_configuration_past_its_time_keeps_the_row_it_printed(tmp_path):
    """A configuration whose processes print their row and then never exit (a stalled tear-down)
    is stopped at --config-timeout, and its row is still read."""
    import sys

    script = tmp_path / "stalls.py"
    script.write_text(
        f'import sys, time\nprint({step_profile.ROW_MARK!r} + \'{{"mode": "coat"}}\', flush=True)\ntime.sleep(60)\n'
    )
    stdout, _, status = step_profile.run_config([sys.executable, str(script)], None, timeout=3)
    assert status == "stopped after 3 s"
    assert stdout.splitlines() == [step_profile.ROW_MARK + '{"mode": "coat"}']
    stdout, _, status = step_profile.run_config([sys.executable, "-c", "print('done')"], None, timeout=30)
    assert (stdout, status) == ("done\n", "exit 0")
