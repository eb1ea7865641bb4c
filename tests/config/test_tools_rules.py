"""The ``tools`` section: its defaults validate, and each rule names its key, the value and the fix; the memory
floor is the sandbox's own."""

import pytest

from config_cases import TINY, ok, problems
from mcpo_megatron.config import ConfigError, load_config, validate
from mcpo_megatron.config.sections.tools import MIN_TOOL_MEMORY_MB


def test_defaults_validate_with_tools_off():
    ok([])
    tools = load_config(None, []).tools
    assert (tools.enabled, tools.backend, tools.format, tools.isolation, list(tools.preload)) == (
        False, "local", "python_block", "auto", ["numpy", "sympy"])


def test_tools_enabled_validates():
    ok(["tools.enabled=true"])
    ok(["tools.enabled=true", "rollout.partial.enable=true", "trainer.max_staleness=1"])
    ok(["tools.enabled=true", "tools.format=chat_template", "data.apply_chat_template=true"])


@pytest.mark.parametrize("overrides,expected", [
    (["tools.format=chat_template", "data.apply_chat_template=false"],
     "tools.format=chat_template: declares the tool and renders its outputs through the chat template, so it needs "
     "data.apply_chat_template=true; set data.apply_chat_template=true, or tools.format=python_block"),
    (["tools.format=chat_template", "data.prompt_template=python_tool"],
     "data.prompt_template=python_tool: describes the python_block call syntax; with tools.format=chat_template the "
     "chat template declares the tool; use another data.prompt_template (e.g. boxed)"),
])
def test_the_chat_template_syntax_needs_the_chat_template(overrides, expected):
    assert expected in problems(["tools.enabled=true", *overrides])


@pytest.mark.parametrize("overrides,expected", [
    (["tools.backend=http"], "tools.http_url=None: must be an http:// or https:// URL with tools.backend=http; give "
                             "the sandbox service's endpoint, e.g. http://sandbox:8080/run"),
    (["tools.backend=http", "tools.http_url=sandbox:8080"],
     "tools.http_url=sandbox:8080: must be an http:// or https:// URL with tools.backend=http; give the sandbox "
     "service's endpoint, e.g. http://sandbox:8080/run"),
    (["tools.max_output_tokens=30000"], "tools.max_output_tokens=30000: must be <= data.max_response_length=20480 "
                                        "(a tool output is part of the response); lower tools.max_output_tokens"),
])
def test_the_rules_of_a_run_that_calls_the_tool(overrides, expected):
    """Checked once tools.enabled=true; inert keys are not held against a run."""
    assert problems(["tools.enabled=true", *overrides]) == [expected]
    ok(overrides)


@pytest.mark.parametrize("overrides,expected", [
    (["tools.backend=grpc"], "tools.backend=grpc: must be one of local | http; set tools.backend to one of those"),
    (["tools.timeout_s=0"], "tools.timeout_s=0.0: must be > 0 (wall-clock limit of a call); use e.g. 10"),
    (["tools.cpu_s=-1"], "tools.cpu_s=-1.0: must be > 0 (CPU-time limit of a call's process); use e.g. 10"),
    (["tools.memory_mb=100"], f"tools.memory_mb=100: must be 0 (no cap) or >= {MIN_TOOL_MEMORY_MB} (MiB of address "
                              "space; python with the preloaded modules takes about 140); use the default 1024"),
    (["tools.preload=[numpy,'os.path; rm']"], "tools.preload=['numpy', 'os.path; rm']: must list module names; not "
                                              "one: 'os.path; rm'; give importable names such as numpy, sympy"),
    (["tools.call_penalty=-0.5"], "tools.call_penalty=-0.5: must be >= 0 (it is subtracted from the reward); use 0 "
                                  "for no penalty"),
    (["tools.workers=0"], "tools.workers=0: must be >= 1; set a positive value"),
    (["tools.max_processes=0"], "tools.max_processes=0: must be >= 1; set a positive value"),
    (["tools.max_turns=0"], "tools.max_turns=0: must be >= 1; set a positive value"),
    (["tools.disk_mb=0"], "tools.disk_mb=0: must be >= 1; set a positive value"),
    (["tools.isolation=docker"], "tools.isolation=docker: must be one of auto | namespaces | plain; set "
                                 "tools.isolation to one of those"),
    (["tools.format=json"], "tools.format=json: must be one of python_block | chat_template; set tools.format to "
                            "one of those"),
])
def test_each_rule_names_its_key(overrides, expected):
    assert problems(overrides) == [expected]


def test_valid_settings_pass():
    ok(["tools.backend=http", "tools.http_url=https://sandbox.internal/run", "tools.memory_mb=0",
        f"tools.memory_mb={MIN_TOOL_MEMORY_MB}", "tools.format=chat_template", "tools.call_penalty=0.1",
        "tools.preload=[numpy,scipy.optimize]", "tools.max_output_tokens=20480"])
    ok(["tools.enabled=true", "tools.backend=http", "tools.http_url=https://sandbox.internal/run",
        "tools.max_output_tokens=20480"])


@pytest.mark.parametrize("memory_mb", [0, 1, 255, 256, 1024])
def test_the_memory_rule_is_the_sandboxs(memory_mb):
    """The schema accepts tools.memory_mb exactly when the sandbox's CallLimits accept its memory_mb."""
    from mcpo_megatron.tools import CallLimits

    cfg = load_config(None, TINY + [f"tools.memory_mb={memory_mb}"])
    try:
        validate(cfg, 1)
        schema_ok = True
    except ConfigError as e:
        schema_ok = not any(p.startswith("tools.memory_mb") for p in e.problems)
    with pytest.raises(ValueError) as refused:  # disk_mb=0: refused after memory_mb, before any process starts
        CallLimits(memory_mb=memory_mb, disk_mb=0)
    sandbox_ok = "disk_mb=0" in str(refused.value)
    assert schema_ok == sandbox_ok == (memory_mb == 0 or memory_mb >= MIN_TOOL_MEMORY_MB)
