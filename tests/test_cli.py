"""The `mcpo` command: subcommand registry, lazy imports, `mcpo config`."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from mcpo_megatron import cli

REPO = Path(__file__).resolve().parent.parent
EXPECTED = ["train", "demo", "selftest", "config", "plan", "check-model", "check-rollout", "eval", "export", "report"]


def test_registry_lists_every_subcommand():
    assert list(cli.SUBCOMMANDS) == EXPECTED
    for name, (module, help_line) in cli.SUBCOMMANDS.items():
        assert module.startswith("mcpo_megatron.commands.") and help_line


def test_help_subprocess_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in EXPECTED:
        assert f"    {name}" in out.stdout
    assert "print the resolved config and validate it" in out.stdout


def test_help_and_config_do_not_import_torch():
    code = textwrap.dedent("""
        import sys, contextlib, io
        from mcpo_megatron.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc_help = main(["--help"])
            before = sorted(m for m in ("torch", "megatron", "omegaconf") if m in sys.modules)
            rc_config = main(["config", "rollout.n=4"])
        after = sorted(m for m in ("torch", "megatron") if m in sys.modules)
        print(rc_help, rc_config, before, after)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 0 [] []"


def test_no_arguments_prints_help(capsys):
    assert cli.main([]) == 2
    assert "check-rollout" in capsys.readouterr().out


def test_version(capsys):
    from mcpo_megatron import __version__
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mcpo {__version__}"


def test_unknown_command(capsys):
    assert cli.main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_config_prints_yaml(capsys):
    rc = cli.main(["config", str(REPO / "configs" / "qwen3_8b_mcpo.yaml"), "rollout.n=8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    printed = yaml.safe_load(out)
    assert printed["rollout"]["n"] == 8
    assert printed["model"]["path"] == "Qwen/Qwen3-8B"
    assert printed["parallelism"]["tensor_model_parallel_size"] == 2
    assert "# world_size=8: dp=4 tp=2 pp=1" in err  # from the recipe's '# world_size: 8' comment
    assert "config OK" in err
    assert "# algorithm preset 'mcpo' (algorithm.name) sets adv_estimator=grpo," in err


def test_config_prints_the_preset_and_its_overrides(capsys):
    rc = cli.main(["config", str(REPO / "configs" / "qwen3_8b_dapo.yaml")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "# algorithm preset 'dapo' (algorithm.name) sets " in err
    assert "mcpo.hinge_kl.enable=False, filter_groups.enable=True, gcpo.enable=False; overridden by explicit " \
           "keys: algorithm.filter_groups.enable=False" in err


def test_config_violation_exits_1_with_every_message(capsys):
    rc = cli.main(["config", "rollout.n=1", "rollout.temperature=0", "--world-size", "1"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "mcpo config: invalid config (2 problems):" in err
    assert "rollout.n=1: must be >= 2" in err
    assert "rollout.temperature=0.0: must be > 0" in err
    assert yaml.safe_load(out)["rollout"]["n"] == 1  # the resolved config is still shown


def test_config_world_size_flag(capsys):
    rc = cli.main(["config", "parallelism.tensor_model_parallel_size=2", "--world-size", "3"])
    assert rc == 1
    assert "world_size=3: world size = TP x PP x DP requires divisibility" in capsys.readouterr().err


def test_config_unknown_key_exits_1(capsys):
    assert cli.main(["config", "rollout.temprature=0.5"]) == 1
    assert "did you mean 'rollout.temperature'?" in capsys.readouterr().err


def test_config_stray_positional(capsys):
    assert cli.main(["config", "a.yaml", "b.yaml"]) == 1
    assert "argument 'b.yaml': only the first argument may be a config file" in capsys.readouterr().err


def test_subcommand_help_delegates(capsys):
    assert cli.main(["config", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: mcpo config" in out and "--world-size" in out


def test_missing_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", ("mcpo_megatron.no_such_module", "x"))
    assert cli.main(["train", "x.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("mcpo train: this command is not available in this installation "
                           "(module mcpo_megatron.no_such_module is missing)")
    assert "Traceback" not in err


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    pkg = tmp_path / "fakecmds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(textwrap.dedent("""
        def add_parser(subparsers):
            p = subparsers.add_parser("train", help="fake")
            p.add_argument("config")
            p.add_argument("--steps", type=int, default=1)
            return p

        def run(args):
            print(f"ran {args.command} {args.config} {args.steps}")
            return 3
    """))
    (pkg / "wrong_name.py").write_text(textwrap.dedent("""
        def add_parser(subparsers):
            return subparsers.add_parser("other")

        def run(args):
            return 0
    """))
    (pkg / "broken_dep.py").write_text("import not_installed_package_xyz\n")
    (pkg / "no_run.py").write_text("def add_parser(subparsers):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fakecmds"


def test_subcommand_contract(fake_modules, monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", (f"{fake_modules}.good", "fake"))
    assert cli.main(["train", "c.yaml", "--steps", "5"]) == 3
    assert capsys.readouterr().out.strip() == "ran train c.yaml 5"
    assert cli.main(["train", "--help"]) == 0
    assert "--steps" in capsys.readouterr().out
    assert cli.main(["train"]) == 2  # usage error from the module's own parser
    assert "the following arguments are required: config" in capsys.readouterr().err


def test_subcommand_contract_violations(fake_modules, monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", (f"{fake_modules}.wrong_name", "fake"))
    assert cli.main(["train"]) == 1
    assert "add_parser() did not register a 'train' subcommand (it registered ['other'])" in capsys.readouterr().err
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", (f"{fake_modules}.broken_dep", "fake"))
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert f"mcpo train: cannot import {fake_modules}.broken_dep: No module named 'not_installed_package_xyz'" in err
    assert "Traceback" not in err
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", (f"{fake_modules}.no_run", "fake"))
    assert cli.main(["train"]) == 1
    assert f"module {fake_modules}.no_run has no run() function" in capsys.readouterr().err


def test_missing_model_directory_fails_before_any_process_starts(tmp_path):
    """`mcpo train CONFIG model.path=/nonexistent` used to start torchrun, and every rank died with a traceback."""
    import subprocess
    import sys

    missing = tmp_path / "no_such_model"
    proc = subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "train",
                           str(REPO / "configs" / "cpu_smollm2_arith.yaml"), f"model.path={missing}"],
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode == 1
    assert (f"model.path={missing}: no such model directory on this machine; give a Hugging Face model directory "
            f"(config.json + safetensors), a hub id 'org/name', or one of builtin:smollm2-135m-instruct, ") in proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr + proc.stdout
    (tmp_path / "empty").mkdir()
    assert cli.main(["config", f"model.path={tmp_path / 'empty'}", "--world-size", "1"]) == 1


def test_model_path_rules(capsys, tmp_path):
    from mcpo_megatron.model_files import local_model_path

    assert [local_model_path(p) for p in ("Qwen/Qwen3-8B", "builtin:x", "/abs", "./rel", "~/m", "a/b/c", "plain")] \
        == [False, False, True, True, True, True, True]
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert local_model_path(str(tmp_path / "org" / "name"))
    assert cli.main(["config", "model.path=builtin:nope", "--world-size", "1"]) == 1
    assert ("model.path=builtin:nope: no such built-in model; use one of builtin:smollm2-135m-instruct"
            in capsys.readouterr().err)
