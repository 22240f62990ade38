# What specmesh runs on: a 3-node NATS cluster (JetStream and monitoring on), valkey for the
# KV transport,
# an OpenTelemetry collector and Jaeger for traces. One job, separate from the services, so
# either can be updated alone.
#
#   nomad var put nomad/jobs nats_gateway_password=... nats_tokenizer_password=... \
#     nats_prefill_password=... nats_decode_password=... nats_drafter_password=... \
#     redis_password=...
#   nomad job run deploy/nomad/specmesh-infra.nomad.hcl
#
# The services then get every NATS node (nats://<node 1>:4222,nats://<node 2>:4222,...: a
# service fails over to another node when its own goes), redis://<valkey host>:6379/0 and
# http://<collector host>:4318 (see specmesh.nomad.hcl). Prometheus finds the services
# through Nomad's service registry (nomad_sd_configs; every specmesh service is tagged
# "metrics"), see README "Deploy with Nomad".

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

variable "valkey_maxmemory" {
  type        = string
  default     = "4gb"
  description = "valkey evicts the least recently used KV blocks beyond this"
}

job "specmesh-infra" {
  datacenters = var.datacenters
  type        = "service"

  # Three nodes on three clients, routed to each other as one cluster (the routes come from
  # Nomad's registry of the "specmesh-nats-cluster" service); two keep serving, and keep
  # JetStream's quorum, while one restarts.
  group "nats" {
    count = 3

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
    }

    service {
      name     = "specmesh-nats"
      provider = "nomad"
      port     = "client"

      check {
        type     = "http"
        port     = "monitor"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"
      }
    }

    service {
      name     = "specmesh-nats-cluster"
      provider = "nomad"
      port     = "cluster"
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "10s"
      mode     = "delay"
    }

    ephemeral_disk {
      sticky  = true # JetStream's store survives task restarts and job updates
      migrate = true
      size    = 2048
    }

    task "nats" {
      driver = "docker"

      config {
        image   = "nats:2.11-alpine"
        command = "nats-server"
        args    = ["--config", "/secrets/nats.conf"]
        ports   = ["client", "cluster", "monitor"]
      }

      # A node joining or leaving changes the routes: SIGHUP reloads them without a restart.
      template {
        destination   = "secrets/nats.conf"
        change_mode   = "signal"
        change_signal = "SIGHUP"
        data          = <<-EOT
          server_name: nats-{{ env "NOMAD_ALLOC_INDEX" }}
          port: 4222
          http_port: 8222
          cluster {
            name: specmesh
            listen: 0.0.0.0:6222
            # every node's route (a node drops the one that leads back to itself)
            routes: [{{ range nomadService "specmesh-nats-cluster" }}"nats-route://{{ .Address }}:{{ .Port }}",{{ end }}]
          }
          # Prompts and draft-step features exceed NATS's 1 MiB default message size.
          max_payload: 8MB
          max_pending: 64MB
          jetstream {
            store_dir: /alloc/data/jetstream
            max_file_store: 1GB
          }
          authorization {
            # one user per kind of service, allowed only its own subjects (as deploy/nats.conf)
            users = [
              {user: gateway, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_gateway_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.tokenizer.tokenize", "specmesh.tokenizer.encode", "specmesh.tokenizer.detokenize", "specmesh.prefill", "specmesh.abort", "specmesh.decode.*.admit", "specmesh.tokenizer.*.resume", "specmesh.cache.*.flush", "specmesh.cache.*.snapshot", "specmesh.heartbeat.gateway"]}, "subscribe": {"allow": ["specmesh.gateway.*.out", "specmesh.heartbeat.*", "specmesh.cache.events", "_INBOX.gateway.>"]}, "allow_responses": true}},
              {user: tokenizer, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_tokenizer_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.gateway.*.out", "specmesh.abort", "specmesh.heartbeat.tokenizer"]}, "subscribe": {"allow": ["specmesh.tokenizer.tokenize", "specmesh.tokenizer.encode", "specmesh.tokenizer.detokenize", "specmesh.abort", "specmesh.heartbeat.gateway", "specmesh.tokenizer.*.detok", "specmesh.tokenizer.*.resume", "_INBOX.tokenizer.>"]}, "allow_responses": true}},
              {user: prefill, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_prefill_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.heartbeat.prefill"]}, "subscribe": {"allow": ["specmesh.prefill", "specmesh.abort", "specmesh.cache.*.flush", "_INBOX.prefill.>"]}, "allow_responses": true}},
              {user: decode, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_decode_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.tokenizer.*.detok", "specmesh.drafter.*", "specmesh.cache.events", "specmesh.heartbeat.decode"]}, "subscribe": {"allow": ["specmesh.decode.*.admit", "specmesh.cache.*.flush", "specmesh.cache.*.snapshot", "specmesh.abort", "specmesh.heartbeat.gateway", "_INBOX.decode.>"]}, "allow_responses": true}},
              {user: drafter, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_drafter_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.learner.examples", "specmesh.learner.refused", "specmesh.heartbeat.drafter"]}, "subscribe": {"allow": ["specmesh.drafter.*", "specmesh.abort", "specmesh.learner.head", "_INBOX.drafter.>"]}, "allow_responses": true}},
              {user: learner, password: "{{ with nomadVar "nomad/jobs" }}{{ .nats_learner_password }}{{ end }}",
               permissions: {"publish": {"allow": ["specmesh.learner.head", "specmesh.heartbeat.learner"]}, "subscribe": {"allow": ["specmesh.learner.examples", "specmesh.learner.refused", "_INBOX.learner.>"]}, "allow_responses": true}}
            ]
          }
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "valkey" {
    count = 1

    network {
      port "redis" {
        static = 6379
      }
    }

    service {
      name     = "specmesh-valkey"
      provider = "nomad"
      port     = "redis"

      check {
        type     = "tcp"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "10s"
      mode     = "delay"
    }

    task "valkey" {
      driver = "docker"

      config {
        image   = "valkey/valkey:8.1-alpine"
        command = "valkey-server"
        args    = ["/secrets/valkey.conf"]
        ports   = ["redis"]
      }

      # A cache of KV blocks: nothing persisted, least recently used blocks evicted.
      template {
        destination = "secrets/valkey.conf"
        change_mode = "restart"
        data        = <<-EOT
          port 6379
          save ""
          appendonly no
          maxmemory ${var.valkey_maxmemory}
          maxmemory-policy volatile-lru
          requirepass "{{ with nomadVar "nomad/jobs" }}{{ .redis_password }}{{ end }}"
        EOT
      }

      resources {
        cpu    = 1000
        memory = 5120
      }
    }
  }

  group "otel-collector" {
    count = 1

    network {
      port "otlp_grpc" {
        static = 4317
      }
      port "otlp_http" {
        static = 4318
      }
      port "health" {
        to = 13133
      }
    }

    service {
      name     = "specmesh-otel-collector"
      provider = "nomad"
      port     = "otlp_http"

      check {
        type     = "http"
        port     = "health"
        path     = "/"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "10s"
      mode     = "delay"
    }

    task "otel-collector" {
      driver = "docker"

      config {
        image = "otel/opentelemetry-collector:0.130.0"
        args  = ["--config=/local/config.yaml"]
        ports = ["otlp_grpc", "otlp_http", "health"]
      }

      # Traces go to Jaeger, found through Nomad's service registry.
      template {
        destination = "local/config.yaml"
        change_mode = "restart"
        data        = <<-EOT
          extensions:
            health_check:
              endpoint: 0.0.0.0:13133
          receivers:
            otlp:
              protocols:
                grpc:
                  endpoint: 0.0.0.0:4317
                http:
                  endpoint: 0.0.0.0:4318
          processors:
            memory_limiter:
              check_interval: 1s
              limit_percentage: 80
              spike_limit_percentage: 20
            batch: {}
          exporters:
            otlp:
              endpoint: {{ range nomadService "specmesh-jaeger-otlp" }}{{ .Address }}:{{ .Port }}{{ end }}
              tls:
                insecure: true
          service:
            extensions: [health_check]
            pipelines:
              traces:
                receivers: [otlp]
                processors: [memory_limiter, batch]
                exporters: [otlp]
        EOT
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }

  group "jaeger" {
    count = 1

    network {
      port "ui" {
        static = 16686
      }
      port "otlp" {
        to = 4317
      }
      port "health" {
        to = 13133
      }
    }

    service {
      name     = "specmesh-jaeger"
      provider = "nomad"
      port     = "ui"

      check {
        type     = "http"
        port     = "health"
        path     = "/status"
        interval = "10s"
        timeout  = "3s"
      }
    }

    service {
      name     = "specmesh-jaeger-otlp"
      provider = "nomad"
      port     = "otlp"
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "10s"
      mode     = "delay"
    }

    task "jaeger" {
      driver = "docker"

      config {
        image = "jaegertracing/jaeger:2.10.0"
        ports = ["ui", "otlp", "health"]
      }

      resources {
        cpu    = 1000
        memory = 2048
      }
    }
  }
}
