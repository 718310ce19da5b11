"""Config files: the shipped ones load, and a wrong key, value or placeholder fails naming it."""
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from pipeline.run import resolve
from tests.common import make_config
from transforms.engines import devices
from transforms.engines.registry import ENGINES, engine_factory
from transforms.engines.vllm import load_vllm

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
    for each in {name, "dataflow-batch.yaml"}:  # a filled copy beside the one it extends
        text = (CONFIGS / each).read_text().replace("<SUBSCRIPTION>", "news")
        for key, value in {"<BUCKET>": "b", "<PROJECT_ID>": "p", "<REGION>": "europe-west4",
                           "<MODEL_NAME>": "m", "<MODEL_DIR>": "m", "<MODEL_REVISION>": "r1",
                           "<IMAGE_TAG>": "v1"}.items():
            text = text.replace(key, value)
        (tmp_path / each).write_text(text)
    config = config_lib.load(tmp_path / name)
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


def test_an_unknown_engine_is_a_config_error_naming_the_known_ones(tmp_path):
    """``model.engine`` picks a backend of the registry (``vllm`` when unset)."""
    raw = local_raw()
    assert config_lib.load(write(tmp_path, raw)).model.engine == "vllm"
    assert engine_factory("vllm") is ENGINES["vllm"] is load_vllm
    raw["model"]["engine"] = "onnx"
    with pytest.raises(config_lib.ConfigError, match=r"model\.engine 'onnx' .*known ones: vllm"):
        config_lib.load(write(tmp_path, raw))


def test_native_dtype_is_bfloat16_only_where_the_hardware_computes_it(monkeypatch):
    settings = make_config().model.model_copy(update={"dtype": "native"})
    for hardware, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(devices, "_computes_bfloat16", lambda h=hardware: h)
        assert devices.resolved_dtype(settings) == expected
    assert devices.resolved_dtype(settings.model_copy(update={"dtype": "float16"})) == "float16"


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


# --- `newsvec config` runs none of the config's code ------------------------------------------

_MARKS_ITS_IMPORT = '''import pathlib
pathlib.Path({marker!r}).write_text("imported: this code ran")
'''
_GET_MODEL_PATH = '''
def get_model_path():
    return {folder!r}
'''


@pytest.fixture
def code_package(tmp_path, monkeypatch):
    """A factory: a package on sys.path that writes a marker file when it is imported, and ships a
    model folder (a config.json that declares no Matryoshka dimensions). Returns (the module to
    name in ``pypackage:``, the marker). ``dotted``: the marker is written by the parent package's
    ``__init__`` and the model module is ``<package>.models`` (``importlib.util.find_spec`` on a
    dotted name imports the parents)."""
    import importlib
    import sys
    import uuid

    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    made: list[str] = []

    def make(dotted: bool = False) -> tuple[str, Path]:
        name = f"newsvec_marker_{uuid.uuid4().hex[:12]}"
        marker = tmp_path / f"{name}.imported"
        folder = tmp_path / f"{name}-model"
        folder.mkdir()
        (folder / "config.json").write_text('{"hidden_size": 384}')
        code = _MARKS_ITS_IMPORT.format(marker=str(marker))
        model_code = _GET_MODEL_PATH.format(folder=str(folder))
        if dotted:
            (root / name).mkdir()
            (root / name / "__init__.py").write_text(code)
            (root / name / "models.py").write_text(model_code)
            module = f"{name}.models"
        else:
            (root / f"{name}.py").write_text(code + model_code)
            module = name
        importlib.invalidate_caches()
        made.append(name)
        return module, marker

    yield make
    for name in made:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def _pypackage_config(tmp_path, module: str, **model) -> Path:
    raw = local_raw()
    raw["model"].update(path=f"pypackage:{module}", **model)
    return write(tmp_path, raw)


@pytest.mark.parametrize("dotted", [False, True], ids=["module", "package.module"])
@pytest.mark.parametrize("dimensions", [{}, {"dimensions": 128,
                                             "truncate_dimensions_knowingly": True}],
                         ids=["dim", "dimensions"])
def test_newsvec_config_validates_a_pypackage_model_without_importing_it(
        tmp_path, code_package, capsys, dotted, dimensions):
    """``newsvec config --config untrusted.yaml`` runs none of the file's code: a ``pypackage:``
    model is looked for on the Python path, not imported, and what needs its files
    (``model.dimensions``) is left to the run, with a line that says so. Before: with
    ``model.dimensions`` set, the module was imported (the marker written), for the module and for
    the package's module alike."""
    from pipeline import cli

    module, marker = code_package(dotted=dotted)
    path = _pypackage_config(tmp_path, module, **dimensions)
    assert cli.main(["config", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert not marker.exists(), f"newsvec config ran the package's code: {marker.read_text()}"
    assert yaml.safe_load(out)["model"]["path"] == f"pypackage:{module}"
    assert "not imported" in err
    if dimensions:
        assert "model.dimensions" in err and "at run time" in err


def test_the_run_still_imports_a_pypackage_model_and_checks_its_dimensions(tmp_path,
                                                                           code_package, capsys):
    """What ``newsvec config`` leaves to the run is checked when the run starts (``resolve``):
    the package imported, ``model.dimensions`` refused for a model that does not declare
    Matryoshka dimensions."""
    from pipeline import cli

    module, marker = code_package()
    path = _pypackage_config(tmp_path, module, dimensions=128)
    assert cli.main(["config", "--config", str(path)]) == 0
    assert not marker.exists()
    with pytest.raises(config_lib.ConfigError, match="truncate_dimensions_knowingly"):
        resolve(["--config", str(path)])
    assert marker.exists(), "the run resolves the model as before"


def test_the_run_names_a_pypackage_model_whose_folder_cannot_be_resolved(tmp_path, monkeypatch):
    """A module found but without ``get_model_path()`` passes ``newsvec config`` (nothing of it
    runs there) and is a config error naming it when the run starts."""
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "newsvec_no_model_path_here.py").write_text("VALUE = 1\n")
    importlib.invalidate_caches()
    path = _pypackage_config(tmp_path, "newsvec_no_model_path_here")
    config_lib.load(path)
    with pytest.raises(config_lib.ConfigError, match="get_model_path"):
        resolve(["--config", str(path)])


@pytest.mark.parametrize("module, says", [
    ("", "not a module name"),
    ("../evil", "not a module name"),
    ("os;touch x", "not a module name"),
    ("a..b", "not a module name"),
    ("1abc", "not a module name"),
    ("pkg.class", "not a module name"),
    ("newsvec_no_such_package_anywhere", "no module"),
    ("json.newsvec_no_such_module", "no module"),
    ("json.decoder.x", "not a package"),
])
def test_a_pypackage_model_that_is_no_module_here_is_refused_naming_it(tmp_path, capsys,
                                                                       module, says):
    from pipeline import cli

    path = _pypackage_config(tmp_path, module)
    assert cli.main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and says in err, err
