"""Config files: the shipped ones load, and a wrong key, value or placeholder fails naming it."""
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from pipeline.run import resolve
from tests.conftest import make_config

CONFIGS = Path(config_lib.REPO_ROOT) / "configs"


def write(tmp_path, data) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def local_raw() -> dict:
    return yaml.safe_load((CONFIGS / "local.yaml").read_text())


@pytest.mark.parametrize("name", ["local.yaml", "local-streaming.yaml"])
def test_local_configs_are_valid_and_run_on_the_cpu(name):
    config = config_lib.load(CONFIGS / name)
    assert config.model.path.startswith("pypackage:") and config.model.dim == 384
    assert config.model.engine_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert not config.model.trust_remote_code


def test_local_streaming_runs_the_engine_in_a_process_of_its_own():
    """In the runner's process, the engine's Python work waits for the GIL behind the streaming
    runner's timers: a soak at 80% of saturation fell behind and its rows came out only at each
    window's end (docs/benchmarks.md, Soak run). Batch keeps it in process: no timers there."""
    assert config_lib.load(CONFIGS / "local-streaming.yaml").model.share_across_processes
    assert not config_lib.load(CONFIGS / "local.yaml").model.share_across_processes


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["model"].update(dtyp="float32"), "model.dtyp"),
    (lambda c: c.update(outptu="x"), "outptu"),
    (lambda c: c["model"].update(dtype="auto"), "model.dtype"),
    (lambda c: c["model"].update(token_budget=0), "model.token_budget"),
    (lambda c: c["dedup"].update(key="url"), "dedup.key"),
    (lambda c: c["parse"].update(max_payload_bytes="big"), "parse.max_payload_bytes"),
    (lambda c: c["beam"].update(runnr="DirectRunner"), "beam.runnr"),
    (lambda c: c["model"].pop("dim"), "model.dim"),
    (lambda c: c["model"].update(token_budget=100), "token_budget"),
])
def test_a_wrong_key_or_value_fails_naming_it(tmp_path, edit, named):
    raw = local_raw()
    edit(raw)
    with pytest.raises(config_lib.ConfigError, match=named.replace(".", r"\.")):
        config_lib.load(write(tmp_path, raw))


def test_unfilled_placeholders_fail_at_start_and_are_listed():
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(CONFIGS / "dataflow-batch.yaml")
    for name in ("beam.project", "beam.region", "output", "model.name"):
        assert name in str(info.value)


@pytest.mark.parametrize("name, gpus", [("dataflow-batch.yaml", 1), ("dataflow-batch-2xl4.yaml", 2),
                                        ("dataflow-streaming.yaml", 1)])
def test_dataflow_configs_are_valid_once_filled(tmp_path, name, gpus):
    text = (CONFIGS / name).read_text().replace("<SUBSCRIPTION>", "news")
    for key, value in {"<BUCKET>": "b", "<PROJECT_ID>": "p", "<REGION>": "europe-west4",
                       "<MODEL_NAME>": "m", "<MODEL_DIR>": "m", "<MODEL_REVISION>": "r1",
                       "<IMAGE_TAG>": "v1"}.items():
        text = text.replace(key, value)
    path = tmp_path / "filled.yaml"
    path.write_text(text)
    config = config_lib.load(path)
    assert config.beam["runner"] == "DataflowRunner"
    assert bool(config.streaming.subscription) == (name == "dataflow-streaming.yaml")
    flags = config.beam_flags()
    assert (f"--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:{gpus};"
            "install-nvidia-driver") in flags
    assert config.model.gpus_per_worker in ("auto", gpus)
    assert not any("no_use_multiple_sdk_containers" in f for f in flags), \
        "one SDK process per vCPU: every core prepares text"
    assert config.model.share_across_processes, "and they share one engine"


def test_flags_override_the_config(tmp_path):
    path = write(tmp_path, local_raw())
    config, options = resolve(["--config", str(path), "--input", "in/*.jsonl", "--output", "o",
                               "--runner", "DirectRunner"])
    assert (config.input, config.output) == ("in/*.jsonl", "o")
    assert options.get_all_options()["runner"] == "DirectRunner"
    config, options = resolve(["--config", str(path)])
    assert config.output == "out/local" and options.get_all_options()["runner"] == "FnApiRunner"


def test_flags_complete_a_config_and_unknown_flags_fail(tmp_path):
    raw = local_raw()
    del raw["output"]
    path = write(tmp_path, raw)
    with pytest.raises(config_lib.ConfigError, match="output"):
        resolve(["--config", str(path)])
    config, _ = resolve(["--config", str(path), "--output", "given"])
    assert config.output == "given"
    with pytest.raises(config_lib.ConfigError, match="--outptu"):
        resolve(["--config", str(path), "--output", "o", "--outptu", "x"])


def test_missing_or_malformed_config_file_is_a_config_error(tmp_path):
    with pytest.raises(config_lib.ConfigError, match="cannot read"):
        config_lib.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(config_lib.ConfigError, match="not valid YAML"):
        config_lib.load(bad)


def test_native_dtype_is_bfloat16_only_where_the_hardware_computes_it(monkeypatch):
    from transforms import model

    settings = make_config().model.model_copy(update={"dtype": "native"})
    for hardware, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(model, "_computes_bfloat16", lambda h=hardware: h)
        assert settings.resolved_dtype() == expected
    assert settings.model_copy(update={"dtype": "float16"}).resolved_dtype() == "float16"


# --- a config file that could cost the loader its stack or seconds of CPU ----------------------

def _alias_bomb(levels: int) -> str:
    """configs/local.yaml with ~2 KB more: a ``beam.experiments`` whose aliases expand to
    9**levels strings."""
    lines = ['    - &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels + 1):
        lines.append(f"    - &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    local = (CONFIGS / "local.yaml").read_text()
    return local.replace("\nbeam:\n", "\nbeam:\n  experiments:\n" + "\n".join(lines) + "\n", 1)


def test_a_config_with_yaml_aliases_is_refused_at_once(tmp_path):
    """Aliases are shared while parsed but walked expanded (the placeholder check, the Beam
    flags): 2 KB of them cost seconds, nine more levels hours. A config has no use for them.
    Before: 9**6 strings were loaded, in seconds, without an error."""
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(6))
    start = time.monotonic()
    with pytest.raises(config_lib.ConfigError, match="alias"):
        config_lib.load(path)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("text", ["x: " + "[" * 5000 + "]" * 5000,
                                  "x:\n" + "".join(" " * i + "- \n" for i in range(1, 1200))])
def test_a_config_nested_too_deep_is_a_config_error_not_a_recursion_error(tmp_path, text):
    """Before: RecursionError, uncaught (in PyYAML's composer)."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(config_lib.ConfigError, match="nested deeper"):
        config_lib.load(path)


def test_a_config_larger_than_any_config_is_refused_before_it_is_parsed(tmp_path):
    """Before: 64 MiB of YAML was parsed (a minute of CPU and gigabytes) before validation."""
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (2 << 20) + "\ninput: x\n")  # 2 MiB
    with pytest.raises(config_lib.ConfigError, match="larger than"):
        config_lib.load(path)
