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
    path = tmp_path / name
    path.write_text(fill((CONFIGS / name).read_text()))
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


def check_gpu_workers(request: dict) -> dict:
    """What both jobs share: L4, image, one SDK process per VM, machine, disk, autoscaling."""
    env = request["environment"]
    assert env["serviceOptions"] == [ACCELERATOR]
    # One SDK process per vCPU (Beam adds this experiment unless told the opposite), and one
    # engine per machine that they share (tested in test_dataflow_configs_keep_...).
    assert "use_multiple_sdk_containers" in env["experiments"]
    assert "no_use_multiple_sdk_containers" not in env["experiments"]
    (pool,) = env["workerPools"]
    assert pool["machineType"] == "g2-standard-8"
    assert pool["diskSizeGb"] == 100
    assert pool["numWorkers"] == 1
    assert pool["autoscalingSettings"] == {"algorithm": "AUTOSCALING_ALGORITHM_BASIC",
                                           "maxNumWorkers": 4}
    assert pool["numThreadsPerWorker"] == 4
    assert pool["workerHarnessContainerImage"] == IMAGE
    assert {i["containerImage"] for i in pool["sdkHarnessContainerImages"]} == {IMAGE}
    options = env["sdkPipelineOptions"]["options"]
    assert (options["project"], options["region"]) == (PROJECT, REGION)
    assert options["sdk_container_image"] == IMAGE
    assert options["service_account_email"] == f"newsvec-worker@{PROJECT}.iam.gserviceaccount.com"
    assert options["dataflow_service_options"] == [ACCELERATOR]
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
        assert config.streaming.batch_shards >= config.beam["max_num_workers"] > 1


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


@pytest.mark.parametrize("name", ["dataflow-batch.yaml", "dataflow-streaming.yaml"])
def test_dataflow_configs_keep_the_model_in_the_image_and_one_engine_per_machine(name, tmp_path):
    config = config_lib.load(filled_config(name, tmp_path))
    assert config.model.path.startswith("/models/")
    env = config.model.engine_env
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert config.model.share_across_processes, "one engine per machine, shared by the processes"
    assert config.model.max_num_batched_tokens == config.model.token_budget, \
        "a call to the engine is one engine step, not vLLM's default 8192-token steps"
    assert 0.5 <= config.model.gpu_memory_utilization <= 0.9
    assert not config.model.enforce_eager
    assert "setup_file" not in config.beam, "newsvec is installed in the image"
    if config.streaming.subscription:
        assert config.streaming.batch_shards >= config.beam["max_num_workers"]


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
    streaming = dated("in", "gs://b/stream/{date}", streaming=config_lib.StreamingSettings(
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
    assert regex("subscription") == config_lib.StreamingSettings.model_fields[
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


# --- Cloud Scheduler ------------------------------------------------------------------------------

def test_scheduler_body_is_a_valid_flex_template_launch_of_yesterdays_news(tmp_path):
    body = json.loads(fill(SCHEDULER_BODY.read_text()))
    request = json_format.ParseDict(body, dataflow.LaunchFlexTemplateRequest.pb()())
    launch = request.launch_parameter
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", launch.job_name)
    assert launch.container_spec_gcs_path.startswith(f"gs://{BUCKET}/")
    assert launch.environment.service_account_email.startswith("newsvec-worker@")
    params = dict(launch.parameters)
    meta = {p["name"]: p for p in metadata()["parameters"]}
    assert set(params) <= set(meta)
    assert {n for n, p in meta.items() if not p.get("isOptional")} <= set(params)
    for name, value in params.items():
        assert re.fullmatch(meta[name]["regexes"][0], value), (name, value)
    assert params["input_date"] == "yesterday"
    # The config it names is the batch config, whose input and output carry the date.
    assert params["config"].endswith("/dataflow-batch.yaml")
    batch = yaml.safe_load((CONFIGS / "dataflow-batch.yaml").read_text())
    assert "{date}" in batch["input"] and "{date}" in batch["output"]
