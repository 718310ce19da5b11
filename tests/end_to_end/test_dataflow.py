"""Dataflow on NVIDIA L4, verified offline.

- The job request Beam's DataflowRunner builds for the batch and the streaming config, through the
  real entry point (``pipeline.run.run``) with ``--dry_run=True``: the runner translates the graph
  and builds the Job, then returns before it creates an API client, stages anything or submits.
  The request's ``environment`` (worker pool, service options, experiments, pipeline options) is
  then built by Beam's own ``apiclient.Environment``, as ``create_job_description`` does after
  staging; nothing touches the network.
- ``{date}`` in the input and output, filled from ``--input_date``.
- The Flex Template metadata against newsvec's own options, and the Cloud Scheduler launch body
  against the Flex Template API's own message types (google-cloud-dataflow-client, which Beam uses).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import re
from pathlib import Path

import apache_beam as beam
import pytest
import yaml
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner
from apache_beam.runners.dataflow.internal import apiclient
from apache_beam.runners.internal import names
from google.cloud import dataflow_v1beta3 as dataflow
from google.protobuf import json_format

from pipeline import config as config_lib
from pipeline.options import NewsvecOptions
from pipeline.run import main, resolve, run
from tests.emulators import gcs_emulator
from transforms.settings import StreamingSettings

CONFIGS = Path(config_lib.REPO_ROOT) / "configs"
METADATA = CONFIGS / "flex-template-metadata.json"
SCHEDULER_BODY = CONFIGS / "scheduler-batch-launch.json"
ACCELERATOR = "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"
PROJECT, REGION, BUCKET = "nv-project", "europe-west4", "nv-bucket"
IMAGE = f"{REGION}-docker.pkg.dev/{PROJECT}/newsvec/worker:v1"
FILL = {"<BUCKET>": BUCKET, "<PROJECT_ID>": PROJECT, "<REGION>": REGION,
        "<MODEL_NAME>": "BAAI/bge-base-en-v1.5", "<MODEL_DIR>": "bge-base-en-v1.5",
        "<MODEL_REVISION>": "a5beb1e3e68b9ab74eb54cfd186867f64f240e1a", "<IMAGE_TAG>": "v1",
        "<SUBSCRIPTION>": "news"}


def fill(text: str) -> str:
    for key, value in FILL.items():
        text = text.replace(key, value)
    unfilled = config_lib._PLACEHOLDER.search(re.sub(r"#.*", "", text))  # comments may name them
    assert not unfilled, f"a placeholder the test does not fill: {unfilled.group()}"
    return text


def filled_config(name: str, tmp_path: Path) -> Path:
    """A filled copy of a shipped config, beside a filled copy of the config it extends."""
    path = tmp_path / name
    text = (CONFIGS / name).read_text()
    path.write_text(fill(text))
    parent = yaml.safe_load(text).get(config_lib.EXTENDS)
    if parent:
        filled_config(parent, tmp_path)
    return path


def job_request(argv: list[str]) -> tuple[dict, dict, beam_runner_api_pb2.Pipeline]:
    """(what run() returned, the Dataflow job request as JSON, the portable pipeline proto)."""
    _, options = resolve(argv)
    runner = DataflowRunner()
    returned = run(argv, test_pipeline=beam.Pipeline(runner=runner, options=options))
    job = runner.job
    staging = job.options.view_as(GoogleCloudOptions).staging_location
    job.proto.environment = apiclient.Environment(
        packages=[], options=job.options,
        environment_version=apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION,
        proto_pipeline_staged_url=FileSystems.join(staging, names.STAGED_PIPELINE_FILENAME),
        proto_pipeline=job.proto_pipeline).proto
    return returned, json.loads(job.json()), job.proto_pipeline


def staged_names(proto: beam_runner_api_pb2.Pipeline) -> set[str]:
    return {beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(d.role_payload).staged_name
            for env in proto.components.environments.values() for d in env.dependencies}


def display_data(proto: beam_runner_api_pb2.Pipeline, step: str) -> bytes:
    return b"".join(d.payload for t in proto.components.transforms.values()
                    if t.unique_name.startswith(step) for d in t.display_data)


def check_gpu_workers(request: dict, machine: str = "g2-standard-8", gpus: int = 1,
                      max_workers: int = 4) -> dict:
    """What every job shares: L4s, image, one SDK process per VM, machine, disk, autoscaling."""
    accelerator = ACCELERATOR.replace("count:1", f"count:{gpus}")
    env = request["environment"]
    assert env["serviceOptions"] == [accelerator]
    # One SDK process per vCPU (Beam adds this experiment unless told the opposite), and one
    # engine per machine that they share (tested in test_dataflow_configs_keep_...).
    assert "use_multiple_sdk_containers" in env["experiments"]
    assert "no_use_multiple_sdk_containers" not in env["experiments"]
    (pool,) = env["workerPools"]
    assert pool["machineType"] == machine
    assert pool["diskSizeGb"] == 100
    assert pool["numWorkers"] == 1
    assert pool["autoscalingSettings"] == {"algorithm": "AUTOSCALING_ALGORITHM_BASIC",
                                           "maxNumWorkers": max_workers}
    assert pool["numThreadsPerWorker"] == 4
    assert pool["workerHarnessContainerImage"] == IMAGE
    assert {i["containerImage"] for i in pool["sdkHarnessContainerImages"]} == {IMAGE}
    options = env["sdkPipelineOptions"]["options"]
    assert (options["project"], options["region"]) == (PROJECT, REGION)
    assert options["sdk_container_image"] == IMAGE
    assert options["service_account_email"] == f"newsvec-worker@{PROJECT}.iam.gserviceaccount.com"
    assert options["dataflow_service_options"] == [accelerator]
    return options


def test_batch_job_request_carries_the_gpu_workers_and_newsvec_options(tmp_path):
    config = filled_config("dataflow-batch.yaml", tmp_path)
    returned, request, proto = job_request(
        ["--config", str(config), "--input_date", "2026-11-30", "--dry_run=True"])
    assert returned["launched"] and "counts" not in returned  # described, not run: no summary
    assert request["type"] == "JOB_TYPE_BATCH"
    options = check_gpu_workers(request)
    assert (options["config"], options["input_date"]) == (str(config), "2026-11-30")
    assert "streaming" not in options or options["streaming"] is False
    # The output prefix of this run's date, in the sinks' display data: the run's staging folder,
    # which CommitRun, the last step, publishes.
    written = display_data(proto, "WriteVectors")
    assert re.search(rb"gs://" + BUCKET.encode() + rb"/newsvec/batch/dt=2026-11-30/_staging/"
                     rb"\d{8}T\d{6}Z-[0-9a-f]{8}/vectors/part-", written)
    assert any(t.unique_name == "CommitRun" for t in proto.components.transforms.values())
    assert b"{date}" not in proto.SerializeToString()
    # newsvec and its dependencies come from the image: no setup_file tarball, no requirements.
    staged = staged_names(proto)
    assert staged <= {"pickled_main_session", "submission_environment_dependencies.txt"}, staged


def test_two_l4_batch_job_request_asks_for_two_gpus_and_runs_an_engine_on_each(tmp_path):
    """configs/dataflow-batch-2xl4.yaml: g2-standard-24 workers with two L4s each, and
    ``model.gpus_per_worker`` equal to the accelerator count (tests/engines/test_devices.py: one
    engine per GPU, the SDK processes spread over them)."""
    config = filled_config("dataflow-batch-2xl4.yaml", tmp_path)
    returned, request, proto = job_request(
        ["--config", str(config), "--input_date", "2026-11-30", "--dry_run=True"])
    assert returned["launched"] and request["type"] == "JOB_TYPE_BATCH"
    check_gpu_workers(request, machine="g2-standard-24", gpus=2, max_workers=2)
    model = config_lib.load(config).model
    assert model.share_across_processes and model.gpus_per_worker == 2
    assert any(t.unique_name == "CommitRun" for t in proto.components.transforms.values())


def test_streaming_job_request_carries_streaming_engine_and_the_subscription(tmp_path):
    config = filled_config("dataflow-streaming.yaml", tmp_path)
    subscription = f"projects/{PROJECT}/subscriptions/from-the-command-line"
    returned, request, proto = job_request(
        ["--config", str(config), "--subscription", subscription, "--dry_run=True"])
    assert returned["launched"]
    assert request["type"] == "JOB_TYPE_STREAMING"
    assert request["name"] == "newsvec-stream"
    options = check_gpu_workers(request)
    experiments = set(request["environment"]["experiments"])
    assert {"enable_streaming_engine", "enable_windmill_service"} <= experiments
    assert options["streaming"] is True and options["enable_streaming_engine"] is True
    assert (options["config"], options["subscription"]) == (str(config), subscription)
    assert request["environment"]["workerPools"][0]["dataDisks"], "streaming has a data disk"
    assert subscription.encode() in proto.SerializeToString(), \
        "the read uses the flag's subscription"
    steps = {t.unique_name for t in proto.components.transforms.values()}
    assert "DropDuplicatesStreaming/KeepFirstPerKey" in steps, "Dataflow: dedup state per key"


@pytest.mark.parametrize("name", ["dataflow-streaming.yaml", "local-streaming.yaml"])
def test_streaming_writes_are_sharded_over_batch_shards(name, tmp_path):
    """The graph ``python -m pipeline`` builds: its one grouping (the micro-batch) is keyed by
    shard over ``streaming.batch_shards``, and the sinks write each micro-batch where it was
    grouped, with no grouping of their own (which would put every row of the job, or every dead
    letter, through one key: one thread on one worker)."""
    from apache_beam.internal import pickler
    from apache_beam.portability import common_urns

    from pipeline.graph import build_streaming

    config = config_lib.load(filled_config(name, tmp_path) if name.startswith("dataflow")
                             else CONFIGS / name)
    pipeline = beam.Pipeline()
    build_streaming(pipeline, config, "20261201T000000Z-0badc0de")
    transforms = pipeline.to_runner_api().components.transforms.values()
    groupings = [t.unique_name for t in transforms
                 if t.spec.urn == common_urns.primitives.GROUP_BY_KEY.urn]
    assert groupings == ["GroupMicroBatches/GroupPerWindowAndShard"]
    (to_batch,) = [t for t in transforms if t.unique_name == "GroupMicroBatches/ToMicroBatch"]
    fn = pickler.loads(beam_runner_api_pb2.ParDoPayload.FromString(
        to_batch.spec.payload).do_fn.payload)[0]
    assert fn._shards == config.streaming.batch_shards
    if name.startswith("dataflow"):
        # two keys per engine at the most workers: docs/streaming.md, Sizing batch_shards
        assert config.streaming.batch_shards >= 2 * config.beam["max_num_workers"] > 2


@pytest.mark.parametrize("name", ["local-streaming.yaml", "dataflow-streaming.yaml"])
def test_streaming_graph_flattens_only_what_is_windowed_alike(name, tmp_path, caplog):
    """Events and their dead letters meet in Flattens before the micro-batch grouping: one
    windowing applied to both, so Beam finds them alike and logs no "must have the same window"
    warning into every streaming job's start (two equal triggers built apart compare unequal)."""
    from pipeline.graph import build_streaming

    config = config_lib.load(filled_config(name, tmp_path) if name.startswith("dataflow")
                             else CONFIGS / name)
    with caplog.at_level(logging.WARNING, logger="apache_beam.transforms.core"):
        build_streaming(beam.Pipeline(), config, "20261201T000000Z-0badc0de")
    assert not [r.getMessage() for r in caplog.records if "same window" in r.getMessage()]


@pytest.mark.parametrize("name", ["dataflow-batch.yaml", "dataflow-streaming.yaml"])
def test_unfilled_dataflow_configs_fail_at_start_naming_project_region_bucket_image(name, capsys):
    with pytest.raises(config_lib.ConfigError) as info:
        resolve(["--config", str(CONFIGS / name)])
    for key in ("beam.project", "beam.region", "beam.temp_location", "beam.sdk_container_image"):
        assert key in str(info.value)
    assert main(["--config", str(CONFIGS / name)]) == 2
    assert "fill in the placeholder" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["dataflow-batch.yaml", "dataflow-batch-2xl4.yaml",
                                  "dataflow-streaming.yaml"])
def test_dataflow_configs_keep_the_model_in_the_image_and_one_engine_per_gpu(name, tmp_path):
    config = config_lib.load(filled_config(name, tmp_path))
    assert config.model.path.startswith("/models/")
    env = config.model.engine_env
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert config.model.share_across_processes, "one engine per GPU, shared by the processes"
    gpus = int(re.search(r"count:(\d+)", config.beam["dataflow_service_options"]).group(1))
    assert config.model.gpus_per_worker in ("auto", gpus), "an engine on every GPU of the worker"
    assert config.model.max_num_batched_tokens == config.model.token_budget, \
        "a call to the engine is one engine step, not vLLM's default 8192-token steps"
    assert 0.5 <= config.model.gpu_memory_utilization <= 0.9
    assert not config.model.enforce_eager
    assert "setup_file" not in config.beam, "newsvec is installed in the image"
    if config.streaming.subscription:
        assert config.streaming.batch_shards >= 2 * config.beam["max_num_workers"]


# --- {date} -------------------------------------------------------------------------------------

NOW = dt.datetime(2026, 12, 1, 0, 30, tzinfo=dt.timezone.utc)


def dated(input_glob: str, output: str = "out/{date}", **changes) -> config_lib.Config:
    base = config_lib.load(config_lib.DEFAULT_CONFIG)
    return base.model_copy(update={"input": input_glob, "output": output, **changes})


@pytest.mark.parametrize("value, day", [
    ("2026-11-30", "2026-11-30"), ("2024-02-29", "2024-02-29"),
    ("today", "2026-12-01"), ("yesterday", "2026-11-30"), (None, "2026-11-30"),
])
def test_input_date_fills_the_date_field(value, day):
    config = config_lib.fill_date(dated("gs://b/news/dt={date}/*.jsonl.gz"), value, NOW)
    assert config.input == f"gs://b/news/dt={day}/*.jsonl.gz"
    assert config.output == f"out/{day}"


def test_today_and_yesterday_are_utc_days():
    late_in_new_york = dt.datetime(2026, 11, 30, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    assert config_lib.parse_input_date("today", late_in_new_york) == dt.date(2026, 12, 1)
    assert config_lib.parse_input_date("yesterday", late_in_new_york) == dt.date(2026, 11, 30)


def test_a_strftime_format_lays_out_the_date():
    config = config_lib.fill_date(dated("gs://b/news/{date:%Y/%m/%d}/*.jsonl", "o/{date:%Y%m%d}"),
                                  "2026-03-07", NOW)
    assert (config.input, config.output) == ("gs://b/news/2026/03/07/*.jsonl", "o/20260307")


@pytest.mark.parametrize("value", ["2026-13-01", "2026-02-30", "30/11/2026", "2026-1-5", "tomorrow",
                                   "Yesterday", "", " 2026-11-30"])
def test_a_bad_input_date_is_a_config_error_naming_the_flag(value):
    with pytest.raises(config_lib.ConfigError, match="--input_date"):
        config_lib.fill_date(dated("gs://b/news/dt={date}/*.jsonl"), value, NOW)


def test_date_field_mistakes_are_config_errors():
    with pytest.raises(config_lib.ConfigError, match=r"unknown field \{dt\}"):
        config_lib.fill_date(dated("gs://b/news/{dt}/*.jsonl"), "2026-11-30", NOW)
    with pytest.raises(config_lib.ConfigError, match="neither input nor output holds a {date}"):
        config_lib.fill_date(dated("gs://b/news/*.jsonl", "out"), "2026-11-30", NOW)
    streaming = dated("in", "gs://b/stream/{date}", streaming=StreamingSettings(
        subscription="projects/p/subscriptions/s"))
    with pytest.raises(config_lib.ConfigError, match="streaming"):
        config_lib.fill_date(streaming, None, NOW)
    # Without a {date} field and without --input_date, nothing changes.
    plain = dated("gs://b/news/*.jsonl", "out")
    assert config_lib.fill_date(plain, None, NOW) is plain


def test_entry_point_fills_the_date_and_still_rejects_unfilled_placeholders(tmp_path, capsys):
    raw = yaml.safe_load(config_lib.DEFAULT_CONFIG.read_text())
    raw.update(input="news/dt={date}/*.jsonl", output="out/dt={date}")
    path = tmp_path / "dated.yaml"
    path.write_text(yaml.safe_dump(raw))
    config, _ = resolve(["--config", str(path), "--input_date", "2026-11-30"])
    assert (config.input, config.output) == ("news/dt=2026-11-30/*.jsonl", "out/dt=2026-11-30")
    assert main(["--config", str(path), "--input_date", "2026-11-31"]) == 2
    assert "--input_date: '2026-11-31' is not a real date" in capsys.readouterr().err
    # {date} is a field; <BUCKET> is a placeholder, and an unfilled one still fails first.
    raw.update(output="gs://<BUCKET>/out/dt={date}")
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(config_lib.ConfigError, match=r"placeholder.*output = 'gs://<BUCKET>"):
        resolve(["--config", str(path), "--input_date", "2026-11-30"])


def test_a_config_on_gcs_is_read_at_launch(tmp_path, monkeypatch):
    """Flex Template launches read their config from the bucket (gcp-storage-emulator here)."""
    import google.auth
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setattr(google.auth, "default", lambda *a, **k: (AnonymousCredentials(), "test"))
    with gcs_emulator(BUCKET, tmp_path) as emulator:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.endpoint)
        from google.cloud import storage

        text = fill((CONFIGS / "dataflow-batch.yaml").read_text())
        storage.Client.create_anonymous_client().bucket(BUCKET).blob(
            "newsvec/configs/dataflow-batch.yaml").upload_from_string(text)
        config, options = resolve(["--config", f"gs://{BUCKET}/newsvec/configs/dataflow-batch.yaml",
                                   "--input_date", "2026-11-30"])
        assert config.input == f"gs://{BUCKET}/news/dt=2026-11-30/*.jsonl.gz"
        assert options.get_all_options()["machine_type"] == "g2-standard-8"
        with pytest.raises(config_lib.ConfigError, match="cannot read the config"):
            resolve(["--config", f"gs://{BUCKET}/newsvec/configs/missing.yaml"])


# --- Flex Template metadata -----------------------------------------------------------------------

def metadata() -> dict:
    return json.loads(METADATA.read_text())


def newsvec_option_names() -> set[str]:
    parser = argparse.ArgumentParser()
    NewsvecOptions._add_argparse_args(parser)
    return {a.dest for a in parser._actions if a.dest != "help"}


def test_template_metadata_is_valid_for_the_dataflow_api():
    parsed = json_format.ParseDict(metadata(), dataflow.TemplateMetadata.pb()())
    assert parsed.name == "newsvec" and parsed.description
    for param in parsed.parameters:
        assert param.label and param.help_text and param.regexes, param.name
        for regex in param.regexes:
            re.compile(regex)


def test_template_parameters_are_exactly_newsvecs_options():
    in_metadata = {p["name"] for p in metadata()["parameters"]}
    ours = newsvec_option_names()
    assert not ours - in_metadata, \
        f"options missing from the template metadata: {ours - in_metadata}"
    assert not in_metadata - ours, \
        f"template parameters newsvec does not accept: {in_metadata - ours}"
    required = {p["name"] for p in metadata()["parameters"] if not p.get("isOptional", False)}
    assert required == {"config"}, "only the config is required (its default is the local CPU one)"


def regex(name: str) -> str:
    (found,) = [p["regexes"][0] for p in metadata()["parameters"] if p["name"] == name]
    return found


def test_template_regexes_agree_with_what_newsvec_accepts():
    assert regex("subscription") == StreamingSettings.model_fields[
        "subscription"].metadata[0].pattern
    for value in ["2026-11-30", "today", "yesterday", "2026-02-30", "2026-1-5", "tomorrow", "",
                  "Today", "2026-11-30T00:00"]:
        try:
            config_lib.parse_input_date(value, NOW)
            accepted = True
        except config_lib.ConfigError:
            accepted = False
        matches = re.fullmatch(regex("input_date"), value) is not None
        assert matches or not accepted, f"the template would refuse {value!r}, which newsvec takes"
        if not matches:
            assert not accepted


def test_the_pipeline_accepts_every_template_parameter(tmp_path):
    batch = filled_config("dataflow-batch.yaml", tmp_path)
    streaming = filled_config("dataflow-streaming.yaml", tmp_path)
    examples = {
        "config": str(batch),
        "input": f"gs://{BUCKET}/news/dt={{date}}/*.jsonl.gz",
        "output": f"gs://{BUCKET}/newsvec/backfill/dt={{date}}",
        "input_date": "2026-11-29",
        "subscription": f"projects/{PROJECT}/subscriptions/other",
    }
    assert set(examples) == {p["name"] for p in metadata()["parameters"]}
    for name, value in examples.items():
        assert re.fullmatch(regex(name), value), (name, value)
    batch_flags = [f"--{k}={v}" for k, v in examples.items() if k != "subscription"]
    config, _ = resolve(batch_flags)
    assert config.input == f"gs://{BUCKET}/news/dt=2026-11-29/*.jsonl.gz"
    assert config.output == f"gs://{BUCKET}/newsvec/backfill/dt=2026-11-29"
    config, _ = resolve([f"--config={streaming}", f"--subscription={examples['subscription']}"])
    assert config.streaming.subscription == examples["subscription"]


# --- The daily launch: Cloud Scheduler starts a Cloud Workflows execution -----------------------

WORKFLOW = CONFIGS / "workflow-daily-launch.yaml"
LAUNCH = "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch"


class Workflows:
    """A tiny evaluator of the Workflows expressions (``${...}``) the daily launch uses, with the
    standard library functions it calls, as Google documents them (time.format: ISO 8601 in UTC,
    "2024-07-12T12:50:33.000000Z"; map.get: null for a missing key). An expression that uses
    anything else fails the test instead of being guessed at."""

    KNOWN = {"default", "map", "get", "text", "substring", "replace_all", "time", "format", "sys",
             "now"}

    def __init__(self, now: dt.datetime):
        self.scope = {
            "default": lambda value, fallback: fallback if value is None else value,
            "map": argparse.Namespace(get=lambda m, key: (m or {}).get(key)),
            "text": argparse.Namespace(substring=lambda s, start, end: s[start:end],
                                       replace_all=lambda s, old, new: s.replace(old, new)),
            "time": argparse.Namespace(format=lambda seconds: dt.datetime.fromtimestamp(
                seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")),
            "sys": argparse.Namespace(now=now.timestamp),
        }

    def eval(self, value, variables: dict):
        """``value`` with every ``${...}`` string evaluated (recursively in maps and lists)."""
        if isinstance(value, dict):
            return {k: self.eval(v, variables) for k, v in value.items()}
        if isinstance(value, list):
            return [self.eval(v, variables) for v in value]
        if not (isinstance(value, str) and value.startswith("${") and value.endswith("}")):
            return value
        code = compile(value[2:-1], "<workflow expression>", "eval")
        unknown = set(code.co_names) - self.KNOWN - set(variables)
        assert not unknown, f"the test's evaluator does not know {unknown} in {value}"
        return eval(code, {"__builtins__": {}}, {**self.scope, **variables})


def workflow() -> dict:
    return yaml.safe_load(fill(WORKFLOW.read_text()))


def step(steps: list, name: str) -> dict:
    (found,) = [s[name] for s in steps if name in s]
    return found


def daily_launch(now: dt.datetime, argument: dict) -> tuple[dict, dict]:
    """(the variables, the evaluated arguments of the launch call) of one execution at ``now``."""
    main = workflow()["main"]
    assert main["params"] == ["args"]
    evaluator, variables = Workflows(now), {"args": argument}
    for assignment in step(main["steps"], "init")["assign"]:
        ((name, expression),) = assignment.items()
        variables[name] = evaluator.eval(expression, variables)
    call = step(main["steps"], "launch")["try"]
    assert call["call"] == LAUNCH
    return variables, evaluator.eval(call["args"], variables)


def scheduled_argument() -> dict:
    """The argument Cloud Scheduler's body starts each execution with."""
    body = json.loads(fill(SCHEDULER_BODY.read_text()))
    assert set(body) <= {"argument", "callLogLevel"}, "a workflow executions.create body"
    return json.loads(body["argument"])  # Workflows takes the argument as a JSON string


@pytest.mark.parametrize("now, day", [
    (dt.datetime(2026, 12, 1, 1, 30, tzinfo=dt.timezone.utc), "2026-11-30"),
    (dt.datetime(2027, 1, 1, 0, 5, tzinfo=dt.timezone.utc), "2026-12-31"),
    (dt.datetime(2028, 3, 1, 1, 30, tzinfo=dt.timezone.utc), "2028-02-29"),
])
def test_the_daily_launch_names_its_job_by_the_day_it_embeds(now, day):
    argument = scheduled_argument()
    assert "input_date" not in argument, "each execution computes its own date"
    variables, args = daily_launch(now, argument)
    launch = args["body"]["launchParameter"]
    assert launch["jobName"] == "newsvec-daily-" + day.replace("-", "")
    assert launch["parameters"]["input_date"] == day, "the job embeds the day its name says"
    assert (variables["input_date"], variables["job_name"]) == (day, launch["jobName"])
    assert str(config_lib.parse_input_date(day, now)) == day, "newsvec reads it as that day"


def test_two_days_launch_two_names_so_a_running_job_blocks_no_other_day():
    monday = daily_launch(dt.datetime(2026, 11, 30, 1, 30, tzinfo=dt.timezone.utc), {})[0]
    tuesday = daily_launch(dt.datetime(2026, 12, 1, 1, 30, tzinfo=dt.timezone.utc), {})[0]
    later = daily_launch(dt.datetime(2026, 12, 1, 3, 0, tzinfo=dt.timezone.utc), {})[0]
    assert monday["job_name"] != tuesday["job_name"]
    assert later["job_name"] == tuesday["job_name"], \
        "a retry of the same day asks for the same name: Dataflow refuses it while that job runs"


def test_a_given_input_date_launches_that_day():
    now = dt.datetime(2026, 12, 1, 1, 30, tzinfo=dt.timezone.utc)
    _, args = daily_launch(now, {"input_date": "2026-11-02"})
    assert args["body"]["launchParameter"]["jobName"] == "newsvec-daily-20261102"
    assert args["body"]["launchParameter"]["parameters"]["input_date"] == "2026-11-02"


def test_the_launch_is_a_valid_flex_template_launch_of_the_batch_config():
    now = dt.datetime(2026, 12, 1, 1, 30, tzinfo=dt.timezone.utc)
    _, args = daily_launch(now, scheduled_argument())
    assert (args["projectId"], args["location"]) == (PROJECT, REGION)
    request = json_format.ParseDict(
        {"projectId": args["projectId"], "location": args["location"], **args["body"]},
        dataflow.LaunchFlexTemplateRequest.pb()())
    launch = request.launch_parameter
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", launch.job_name)
    assert launch.container_spec_gcs_path == f"gs://{BUCKET}/newsvec/templates/newsvec.json"
    assert launch.environment.service_account_email.startswith("newsvec-worker@")
    params = dict(launch.parameters)
    meta = {p["name"]: p for p in metadata()["parameters"]}
    assert set(params) <= set(meta)
    assert {n for n, p in meta.items() if not p.get("isOptional")} <= set(params)
    for name, value in params.items():
        assert re.fullmatch(meta[name]["regexes"][0], value), (name, value)
    # The config it names is the batch config, whose input and output carry the date.
    assert params["config"] == f"gs://{BUCKET}/newsvec/configs/dataflow-batch.yaml"
    batch = yaml.safe_load((CONFIGS / "dataflow-batch.yaml").read_text())
    assert "{date}" in batch["input"] and "{date}" in batch["output"]


def test_a_refused_launch_fails_the_execution_naming_the_job():
    """Dataflow answers 409 ALREADY_EXISTS to a launch under an active job's name, and the
    connector raises it as an HttpError: the workflow retries only what is transient and raises
    the rest again, so the execution fails (and its alert fires) instead of ending as a success."""
    launch = step(workflow()["main"]["steps"], "launch")
    assert launch["retry"] == "${http.default_retry}"
    handler = launch["except"]
    *_, last = handler["steps"]
    ((_, body),) = last.items()
    assert set(body) == {"raise"}, "the error is raised again, never swallowed"
    assert not any("return" in s or "next" in s for h in handler["steps"] for s in h.values())
    message = Workflows(dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)).eval(
        body["raise"].replace("json.encode_to_string(e)", "e"),
        {"job_name": "newsvec-daily-20261130", "input_date": "2026-11-30",
         "e": '{"code":409,"message":"There is already an active job named ..."}'})
    assert "newsvec-daily-20261130" in message and "409" in message
