# newsvec worker image for Dataflow GPU workers (NVIDIA L4), and the launcher image of its Flex
# Template: one image, so the job is built with the same Python, Beam and newsvec that run it.
#
#   docker build -t IMAGE --build-arg MODEL_ID=BAAI/bge-base-en-v1.5 \
#     --build-arg MODEL_REVISION=<commit sha> --build-arg MODEL_DIR=bge-base-en-v1.5 \
#     --build-arg PYTHON_DIGEST=sha256:... --build-arg BEAM_SDK_DIGEST=sha256:... \
#     --build-arg LAUNCHER_DIGEST=sha256:... .
#   (or: gcloud builds submit --config configs/cloudbuild.yaml ..., see docs/dataflow.md)
#
# - Python 3.11: vllm 0.32.0's CUDA wheel (cp38-abi3) needs Python >= 3.11, torch 2.13.0 has cp311
#   wheels, Beam 2.77 supports 3.10-3.14 on Dataflow, and 3.11 is the Python of newsvec's own tests
#   and local launches (Beam pickles the job's functions: launcher and workers need one Python).
# - Python packages: exactly configs/worker-requirements.txt (CUDA 13.0 torch and vLLM from PyPI;
#   workers need an NVIDIA driver >= 580), each file checked against the lock's sha256
#   (--require-hashes), then newsvec itself without dependencies.
# - Every base image by digest (below), and the image runs as uid 10001, not root (at the end).
# - Beam's worker boot entrypoint from Beam's SDK image of the same Beam and Python version.
# - The model is downloaded once, at build time, into /models/MODEL_DIR; nothing is downloaded at
#   run time (the Dataflow configs also set HF_HUB_OFFLINE=1 in model.engine_env).
ARG PYTHON_VERSION=3.11
# The interpreter of the image, to the patch level (python:<this>-slim-bookworm): 3.11.16 or later
# has the fixes for html.parser's quadratic time on markup that never closes (CVE-2025-6069, in
# 3.11.14) and unicodedata.normalize's on long runs of combining marks (CVE-2026-3276,
# gh-149079, in 3.11.16). newsvec's own bounds on hostile text hold on any 3.11
# (docs/input.md#limits); these close the same holes for anything else in the image.
ARG PYTHON_RELEASE=3.11.18
ARG BEAM_VERSION=2.77.0
# Dataflow's Python Flex Template launcher; its name carries the Python version.
ARG LAUNCHER_IMAGE=gcr.io/dataflow-templates-base/python311-template-launcher-base
# The three base images by digest (sha256:<64 hex>), so a tag moved or replaced upstream changes
# nothing here. No defaults: a build without them stops at its first FROM ("${NAME:?}"). Get them
# for the tags above with `docker buildx imagetools inspect IMAGE:TAG` (its "Digest:" line) or, for
# the launcher, `gcloud container images describe IMAGE:latest --format='value(image_summary.digest)'`,
# and keep them with the release (docs/dataflow.md, Image).
ARG PYTHON_DIGEST
ARG BEAM_SDK_DIGEST
ARG LAUNCHER_DIGEST

FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}@${BEAM_SDK_DIGEST:?} AS beam

FROM ${LAUNCHER_IMAGE}@${LAUNCHER_DIGEST:?} AS launcher

# The model, at a pinned revision (a commit sha), in a stage of its own: a code change does not
# download it again.
FROM python:${PYTHON_RELEASE}-slim-bookworm@${PYTHON_DIGEST:?} AS model
ARG MODEL_ID
ARG MODEL_REVISION
ARG MODEL_DIR
ARG HF_HUB_VERSION=2.4.0
COPY configs/worker-requirements.txt /tmp/worker-requirements.txt
# huggingface-hub and what it needs, each file checked against the lock's hashes (pip applies a
# constraint's hashes, and --require-hashes refuses anything the lock does not hash).
RUN test -n "${MODEL_ID}" && test -n "${MODEL_REVISION}" && test -n "${MODEL_DIR}" \
    && pip install --no-cache-dir --require-hashes --only-binary=:all: \
        -c /tmp/worker-requirements.txt "huggingface-hub==${HF_HUB_VERSION}" \
    && hf download "${MODEL_ID}" --revision "${MODEL_REVISION}" --local-dir "/models/${MODEL_DIR}" \
    && rm -rf "/models/${MODEL_DIR}/.cache"

FROM python:${PYTHON_RELEASE}-slim-bookworm@${PYTHON_DIGEST:?}

# A C compiler: Triton (torch.compile, vLLM's kernels) builds small launchers at run time. Debian's
# security updates move the exact versions, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /template

COPY configs/worker-requirements.txt /tmp/worker-requirements.txt
# --require-hashes: every file pip fetches must match a sha256 of its line in the lock.
RUN pip install --no-cache-dir --require-hashes --only-binary=:all: \
        --no-binary=google-apitools -r /tmp/worker-requirements.txt

COPY --from=model /models /models
COPY --from=beam /opt/apache/beam /opt/apache/beam
COPY --from=launcher /opt/google/dataflow/python_template_launcher \
    /opt/google/dataflow/python_template_launcher

COPY setup.py setup.cfg ./
COPY pipeline/ pipeline/
COPY transforms/ transforms/
# newsvec without dependencies (they are all above), then a check that nothing is missing. main.py is
# the Flex Template's entry point: python -m pipeline, with the template's parameters as flags.
RUN pip install --no-cache-dir --no-deps . \
    && pip check \
    && printf '%s\n' '"""Flex Template entry point: python -m pipeline."""' 'import sys' \
        'from pipeline.run import main' 'sys.exit(main())' > /template/main.py
COPY configs/ configs/
COPY docker/entrypoint.sh /opt/newsvec/entrypoint.sh

# The user the workers and the launcher run as: a fixed uid and gid (10001), no login shell. It
# owns only the folders it writes: its home (vLLM's, Triton's and Hugging Face's caches under
# ~/.cache and ~/.triton), the folder where Beam's boot makes each SDK process's venv, and the Flex
# Template launcher's log folder. The code, the Python packages and the model stay root's and
# read-only to it. /tmp is everyone's, as in any image. GPUs: Dataflow mounts the driver under
# /usr/local/nvidia and the /dev/nvidia* devices, which are readable and writable by every user.
RUN groupadd --gid 10001 newsvec \
    && useradd --uid 10001 --gid 10001 --home-dir /home/newsvec --create-home \
        --shell /usr/sbin/nologin newsvec \
    && mkdir -p /opt/apache/beam-venv /var/log/dataflow/template_launcher \
    && chown 10001:10001 /home/newsvec /opt/apache/beam-venv /var/log/dataflow/template_launcher
USER 10001:10001

# Dataflow mounts the NVIDIA driver's libraries and tools under /usr/local/nvidia.
ENV HOME=/home/newsvec \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib \
    PATH=/usr/local/nvidia/bin:${PATH} \
    VLLM_NO_USAGE_STATS=1 \
    FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main.py

# Workers start Beam's boot, through docker/entrypoint.sh (a semi-persistent folder this user can
# write); a Flex Template launch runs /opt/google/dataflow/python_template_launcher.
ENTRYPOINT ["/opt/newsvec/entrypoint.sh"]
