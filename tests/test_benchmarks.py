"""The benchmark scripts run end to end (tiny sizes, CPU), so a GPU session can run them as they are."""

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import finished, started_per_test

ROOT = Path(__file__).resolve().parent.parent


def _run_at_once(*commands: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """The commands run at the same time (the checks of a script's output, not of its figures: each process spends
    most of its seconds importing on one core, so two overlap), each one's ``CompletedProcess`` in order."""
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for command in commands
    ]
    done = []
    try:
        for command, process in zip(commands, processes):
            out, err = process.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:  # a timeout: none left behind
                process.kill()
                process.wait()
    return done


#: test -> its benchmark's command (``folder``: a fresh folder for what it writes), for :func:`started`
COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "test_memory_benchmark_runs_and_reports_every_mode": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--device", "cpu", "--size", "tiny", "--steps", "1",
        "--batch", "2", "--seq", "16", "--modes", "fp32", "ours+masters", "ours+remainder",
        "--json", str(folder / "rows.json"),
    ],
    "test_policy_overhead_benchmark_runs": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "policy_overhead.py"), "--steps", "1", "--batch", "2", "--seq", "8",
    ],
    "test_compare_interleaves_the_modes_step_by_step_and_writes_json_markdown_and_chart": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--device", "cpu", "--preset", "tiny",
        "--out", str(folder), "--workloads", "mlp", "minilm", "--modes", "fp32", "ours+masters", "--steps", "3",
    ],
    "test_reference_experiment_runs_the_cli_once_per_precision": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "reference.py"), "--tiny", "--precisions", "32-true", "bf16-mixed",
        "--out", str(folder),
    ],
    "test_lean_generic_skip_benchmark_times_host_and_device_skips": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "lean_generic_skip.py"), "--params", "0.05", "--rounds", "1",
        "--warmup", "0",
    ],
    "test_framework_overhead_benchmark_runs_every_mode": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "framework_overhead.py"), "--steps", "3", "--rounds", "2",
    ],
    "test_step_alone_benchmark_times_every_mode_and_names_the_path": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "step_alone.py"), "--tensors", "2", "--numel", "65536",
        "--steps", "4", "--rounds", "1", "--warmup", "1",
    ],
    "test_grad_check_benchmark_times_both_checks_on_every_layout": lambda folder: [
        sys.executable, str(ROOT / "benchmarks" / "grad_check.py"), "--rounds", "1", "--shrink", "512",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The chosen tests' benchmark runs (:data:`COMMANDS`), each in a fresh process as a user runs it, two at a time
    (their output's shape is checked, not their figures): ``{test: (its future, its folder)}``."""

    def job(name: str) -> Callable[[Path], subprocess.CompletedProcess]:
        return lambda folder: subprocess.run(COMMANDS[name](folder), capture_output=True, text=True, timeout=600)

    with started_per_test(request, tmp_path_factory, {name: job(name) for name in COMMANDS}) as runs:
        yield runs


def test_memory_benchmark_runs_and_reports_every_mode(started, request):
    done, tmp_path = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["mode"] for r in rows] == ["fp32", "ours+masters", "ours+remainder"]
    fp32, masters, lean = rows
    # the tiny encoder's norm parameters stay fp32 (16 bytes each), every other one costs 18 with masters
    assert fp32["state_bytes"] == 16 * fp32["params"]
    assert 16 * masters["params"] < masters["state_bytes"] < 18 * masters["params"]
    # lean masters between steps: 14 (2 bf16 weight + 2 remainder + 2 bf16 gradient, kept after the step as the
    # built-in keeps its own, + 8 moments; 12 with zero_grad_after_step=True), the few norms 16 (4 fp32 weight + 4 + 8)
    assert 14 * lean["params"] < lean["state_bytes"] < 14.1 * lean["params"]
    assert "| ours+masters | bf16-mixed |" in done.stdout


def test_policy_overhead_benchmark_runs(started, request):
    done, _ = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    for policy in ("autocast", "passthrough", "conservative"):
        assert f"| {policy} |" in done.stdout


def _compare(tmp_path, *extra):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "compare.py"),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--out",
        str(tmp_path),
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_compare_interleaves_the_modes_step_by_step_and_writes_json_markdown_and_chart(started, request):
    done, tmp_path = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["reference"] == "builtin-bf16" and set(result["ceilings_flops"]) == {"float32", "bfloat16"}
    for rows in result["results"].values():
        fp32, masters = rows
        assert (fp32["mode"], fp32["dtype"], masters["mode"], masters["dtype"]) == (
            "fp32",
            "float32",
            "ours+masters",
            "bfloat16",
        )
        # one step each in turn: the global step order alternates between the two processes
        assert fp32["order"] == [0, 2, 4] and masters["order"] == [1, 3, 5]
        for row in rows:
            assert row["steps"] == 3 and row["timed_steps"] == 2
            assert row["samples_s"] == pytest.approx(row["batch"] / (row["step_ms"] / 1e3))
            assert row["speed_vs_fp32"] == pytest.approx(row["samples_s"] / fp32["samples_s"])
            assert row["speed_vs_builtin"] is None  # builtin-bf16 was not run
            assert math.isfinite(row["final_loss"]) and row["nonfinite_losses"] == 0
            assert 0.0 <= row["test_acc"] <= 1.0 and row["test_n"] > 0
        assert fp32["speed_vs_fp32"] == 1.0
        assert fp32["skipped_steps"] is None  # no scaler, nothing counted
        assert masters["skipped_steps"] == 0  # bf16 checks each step (no scaling) and counts what it skips
        # bf16 with fp32 masters trains like fp32 over a few steps (same seed, data and order)
        assert masters["final_loss"] == pytest.approx(fp32["final_loss"], abs=0.02)
    mlp, text = result["results"]["mlp"][0], result["results"]["minilm"][0]
    assert mlp["tokens_s"] is None and mlp["mfu"] is None
    assert text["tokens_s"] == pytest.approx(text["samples_s"] * 16)  # tiny preset: sequences padded to 16 tokens
    assert text["mfu"] == pytest.approx(text["model_tflops_s"] * 1e12 / result["ceilings_flops"]["float32"])
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "results.md").read_text()
    assert "| ours+masters | bfloat16 |" in table and "**minilm**" in table
    assert "| fp32 | float32 |" in done.stdout


def _compare_main():
    """``compare.main``, called in-process (the script's own entry point) for the cases that need no result."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compare import main

    return main


def test_compare_refuses_a_workload_the_preset_has_not_sized(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        _compare_main()(["--device", "cpu", "--preset", "tiny", "--out", str(tmp_path), "--workloads", "resnet50"])
    assert exited.value.code == 2
    assert "workload(s) ['resnet50'] have no sizes in preset 'tiny'" in capsys.readouterr().err


def test_compare_gives_up_on_a_workload_that_outlives_its_timeout(tmp_path):
    arguments = ["--device", "cpu", "--preset", "tiny", "--out", str(tmp_path), "--workloads", "mlp"]
    with pytest.raises(RuntimeError, match=r"workload 'mlp': did not finish within --timeout 0\.5 s"):
        _compare_main()([*arguments, "--modes", "fp32", "ours", "--timeout", "0.5"])
    assert not (tmp_path / "results.json").exists()


def test_compare_names_the_mode_that_failed_with_its_traceback_instead_of_hanging(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compare import run_workload

    args = {
        "device": "cpu",
        "preset": "no-such-preset",
        "steps": 2,
        "seed": 0,
        "out": str(tmp_path),
        "profile": [],
        "timeout": 300,
    }
    failed = r"(?s)workload 'mlp', mode '(fp32|ours)' failed:.*preset='no-such-preset' is not known"
    with pytest.raises(RuntimeError, match=failed):
        run_workload("mlp", ["fp32", "ours"], args)


def test_reference_experiment_runs_the_cli_once_per_precision(started, request):
    done, tmp_path = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 32-true |" in done.stdout and "| bf16-mixed |" in done.stdout
    for precision in ("32-true", "bf16-mixed"):
        assert list((tmp_path / precision).glob("lightning_logs/version_*/metrics.csv"))


def test_lean_generic_skip_benchmark_times_host_and_device_skips(started, request):
    done, _ = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    for option in ("| host |", "| device |", "| device, skip |"):
        assert option in done.stdout


def test_framework_overhead_benchmark_runs_every_mode(started, request):
    done, _ = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| builtin") or line.startswith("| ours")]
    assert [row.split(" | ")[0] for row in rows] == ["| builtin-bf16", "| ours-bf16", "| ours-bf16 without check"]
    assert rows[0].endswith("| 1.00x |")  # the reference against itself


def test_convergence_benchmark_trains_each_mode_in_both_regimes_and_writes_table_and_curves(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--out", str(tmp_path)]
    command += ["--modes", "fp32", "bf16-true", "ours+remainder", "--sources", "rotten_tomatoes", "rotten_tomatoes"]
    command += ["--jobs", "3"]  # the three modes' processes at once (no step time is checked here)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["mode"], r["regime"]): r for r in result["rows"]}
    assert set(rows) == {(m, g) for m in ("fp32", "bf16-true", "ours+remainder") for g in ("pretrain", "finetune")}
    for row in rows.values():
        assert row["curve"][0][0] == 0 and row["curve"][-1][0] == (8 if row["regime"] == "pretrain" else 6)
        assert all(math.isfinite(loss) for _, loss in row["curve"])
    # every mode starts from the same weights: the seed's init, then the one fp32 checkpoint
    for regime in ("pretrain", "finetune"):
        assert len({round(rows[m, regime]["curve"][0][1], 2) for m in ("fp32", "bf16-true", "ours+remainder")}) == 1
    # exact masters update as fp32 does; bf16 weights and state hold 8 bytes/param, fp32 16, lean masters 14 between
    # steps (their bf16 gradients kept after the step, as the built-in keeps its own; 12 with zero_grad_after_step=True)
    assert rows["ours+remainder", "finetune"]["final"] == pytest.approx(rows["fp32", "finetune"]["final"], abs=2e-3)
    params, rows_modes = rows["fp32", "pretrain"]["params"], ("fp32", "bf16-true", "ours+remainder")
    # (the lean step's fixed-size staging buffers counted apart: they do not grow with the model)
    rest = {m: (rows[m, "pretrain"]["at_rest"] - rows[m, "pretrain"]["fixed"]) / params for m in rows_modes}
    assert rest["fp32"] == pytest.approx(16, abs=0.1) and rest["bf16-true"] == pytest.approx(8, abs=0.1)
    assert rest["ours+remainder"] == pytest.approx(14, abs=0.1)  # the README's convergence row: 14.07
    assert (tmp_path / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert '| ours `"remainder"` |' in (tmp_path / "results.md").read_text() and "| fp32 |" in done.stdout
    # the picture and table again from the saved rows, without training
    again = tmp_path / "again.png"
    replot = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--replot", str(tmp_path / "results.json")]
    done = subprocess.run([*replot, "--png", str(again), "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and '| ours `"remainder"` |' in done.stdout


def test_step_alone_benchmark_times_every_mode_and_names_the_path(started, request):
    done, _ = finished(started, request)
    assert done.returncode == 0, done.stderr[-3000:]
    starts = ("| builtin", "| bf16-true", "| remainder")
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith(starts)]
    from lightning_mp.kernels import native

    path = "| remainder (one pass)" if native.cpu_kernel() is not None else "| remainder (chunked)"  # no C compiler
    eight_bit = ["| remainder AdamW8bit", "| remainder AdamW8bit, in backward", "| remainder AdamW8bit, generic"]
    assert rows == ["| builtin AdamW", "| builtin AdamW(fused)", "| bf16-true AdamW(fused)", path,
                    "| remainder, chunked", *eight_bit]  # fmt: skip
    assert "first step of the first fit" in done.stdout


def test_grad_check_benchmark_times_both_checks_on_every_layout(started, request):
    from lightning_mp.kernels import native

    done, _ = finished(started, request)
    if native.cpu_kernel() is None:  # no C compiler: the script says so instead of timing torch's kernel alone
        assert done.returncode != 0 and "not built here" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ")[:2] for line in done.stdout.splitlines() if line.startswith("| ") and "x 2^" in line]
    layouts = ["| 32 x 2^19", "| 256 x 2^19", "| 1 x 2^27"]
    methods = ["torch kernel (read + write)", "compiled check (read only)"]
    assert rows == [[layout, method] for layout in layouts for method in methods]


def test_kernel_contract_benchmark_measures_both_kernels_against_float64_on_every_case(tmp_path):
    """The contract table on the CPU (torch's fused kernel and the C kernel, each against float64): a row per
    optimizer configuration and gradient dtype, every one within the contract; the JSON has the same rows."""
    from lightning_mp.kernels import contract, native

    if native.cpu_kernel() is None:
        pytest.skip("no C compiler here: the C kernel cannot be built")
    command = [sys.executable, str(ROOT / "benchmarks" / "kernel_contract.py"), "--device", "cpu"]
    done = subprocess.run(command + ["--json", str(tmp_path / "k.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| adam", "| sgd"))]
    assert len(rows) == 2 * len(contract.CASES) and all(row.endswith("| yes |") for row in rows)
    saved = json.loads((tmp_path / "k.json").read_text())["contract"]
    assert [r["case"] for r in saved] == [contract.case_name(k, f) for k, f in contract.CASES] * 2
    assert all(r["C kernel"] == r["torch"] for r in saved)  # bitwise, so the same distance


@pytest.fixture(scope="module")
def step_traces() -> dict[str, subprocess.CompletedProcess]:
    """``step_trace.py --json`` (the step after backward) and ``--json --whole`` (the whole batch), each in a fresh
    process as a user runs it, the two at the same time (counts, not timings)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "step_trace.py"), "--json"]
    return dict(zip(("step", "whole"), _run_at_once(command, [*command, "--whole"])))


def test_step_trace_names_the_files_and_functions_one_lean_step_executes(step_traces):
    done = step_traces["step"]
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    by_file = result["by_file"]
    assert result["files"] == len(by_file)
    assert result["functions"] == sum(len(functions) for functions in by_file.values())
    assert result["calls"] == sum(sum(functions.values()) for functions in by_file.values())
    # the step goes through the dispatch (its path chosen once), and the one module that follows the user
    assert "Updates.of" in by_file["lightning_mp/master/lean/update.py"]
    assert by_file["lightning_mp/master/following.py"] == {"seen": 2}
    # issue 52's budget: one lean step executes at most 12 of the project's files and 50 functions
    assert result["files"] <= 12 and result["functions"] <= 50, (result["files"], result["functions"])


def test_the_whole_lean_step_asks_the_following_module_three_times(step_traces):
    """``step_trace.py --whole`` (forward, backward and the step): what the user changed is asked of
    ``following.seen`` before backward, at the unscale and at the update, and of nothing else."""
    done = step_traces["whole"]
    assert done.returncode == 0, done.stderr[-3000:]
    by_file = json.loads(done.stdout)["by_file"]
    assert by_file["lightning_mp/master/following.py"] == {"seen": 3}
    assert "lightning_mp/master/watched.py" not in by_file


def test_decoder_benchmark_times_the_modes_in_turns_in_one_process():
    """``decoder.py --interleaved``: every mode's steps taken in turns in one process, a row per mode."""
    modes = ["ours+remainder", "ours+remainder+inbackward", "builtin-bf16-fused"]
    command = [sys.executable, str(ROOT / "benchmarks" / "decoder.py"), "--interleaved", "--steps", "3", "--seq", "16"]
    done = subprocess.run([*command, "--modes", *modes], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ours") or "| builtin" in line]
    assert [row[0].strip("| ") for row in rows] == modes
    assert rows[0][2] == "1.000x" and all(row[3].strip(" |") == "1" for row in rows)  # 3 steps, the first 2 not timed
    refused = subprocess.run([*command, "--modes", "ours+remainder+compile"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--interleaved takes the modes" in refused.stderr


def test_adam8bit_alone_times_the_chosen_modes_against_torchs_fused_update():
    """``adam8bit_alone.py``: the update alone, the modes asked for (the compiled torchao ones left out here: their
    compile is slow), a row each, the fused fp32 update the reference; ``--start-step`` runs them from a late step."""
    names = ["torch AdamW(fused), fp32", "lean AdamW", "lean AdamW8bit", "lean AdamW8bit, kernel alone"]
    command = [sys.executable, str(ROOT / "benchmarks" / "adam8bit_alone.py"), "--tensors", "2", "--numel", "8192"]
    done, late = _run_at_once(  # the two runs at once: their rows are checked, not their times
        [*command, "--steps", "2", "--rounds", "1", "--modes", *names],
        [*command, "--steps", "1", "--rounds", "1", "--start-step", "20000", "--modes", *names[:3]],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line.split(" | ")[0][2:] for line in done.stdout.splitlines() if line.startswith("| ") and "ms)" not in line
    ]
    assert rows == names
    assert "| torch AdamW(fused), fp32 |" in done.stdout and " | 1.00x |" in done.stdout
    assert late.returncode == 0, late.stderr[-3000:]
    assert "from step 20000" in late.stdout and "| lean AdamW8bit |" in late.stdout


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--tune"], "--tune times the Triton kernel's launch shapes: it needs --device cuda"),
        (["--best", "shape.txt"], "--best is written by --tune"),
    ],
)
def test_adam8bit_alone_tunes_the_triton_launch_shape_on_cuda_only(monkeypatch, capsys, argv, said):
    """``--tune`` times the Triton kernel's launch shapes (a GPU run: ``benchmarks/run_gpu.sh``'s eightbit stage);
    on the CPU it is refused, naming what it needs, before any work (its ``main``, in this process)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import adam8bit_alone
    finally:
        while str(ROOT / "benchmarks") in sys.path:
            sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["adam8bit_alone.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        adam8bit_alone.main()
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_run_gpu_eightbit_stage_runs_the_8bit_checks_with_the_tuned_shape(tmp_path):
    """What a CPU can check of the GPU script's eightbit stage (shown with PYTHON=echo): its commands in order, the
    tuned shape's file written by --tune and read by the runs after it, and the modes it names known to the scripts."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "STAGES": "eightbit"}
    script = ROOT / "benchmarks" / "run_gpu.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("-m pytest", "benchmarks/"))]
    assert [line.split()[0] for line in lines] == [
        "-m", "benchmarks/adam8bit_alone.py", "benchmarks/adam8bit_alone.py", "benchmarks/decoder.py"
    ]  # fmt: skip
    assert lines[0].endswith("tests/test_cuda_adam8bit.py") and "-m gpu" in lines[0]
    assert f"--tune --rounds 3 --steps 20 --best {tmp_path}/best_8bit.txt" in lines[1]
    assert done.stdout.count("best_8bit.txt: No such file") == 2  # read by the two runs after --tune (echo wrote none)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import adam8bit_alone
        import decoder
    finally:
        while str(ROOT / "benchmarks") in sys.path:
            sys.path.remove(str(ROOT / "benchmarks"))
    named = lines[2].split("--modes ", 1)[1]
    assert [m for m in adam8bit_alone.MODES if m in named] == [
        "torch AdamW(fused), fp32", "torch AdamW(fused), bf16", "torchao AdamW8bit, fp32", "lean AdamW",
        "lean AdamW8bit",
    ]  # fmt: skip
    modes = lines[3].split("--modes ", 1)[1].split()
    assert modes == ["builtin-bf16-true", "builtin-bf16-fused", "ours+remainder+8bit", "ours+remainder+8bit+inbackward"]
    assert set(modes) <= set(decoder.MODES)
