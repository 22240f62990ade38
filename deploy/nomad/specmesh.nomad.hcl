# specmesh's five services on Nomad, one group each, each with its own count.
# Start the infrastructure first (specmesh-infra.nomad.hcl), then pass its addresses in:
#
#   nomad job run -var nats_url=nats://10.0.0.10:4222,nats://10.0.0.11:4222,nats://10.0.0.12:4222 \
#     -var otlp_endpoint=http://10.0.0.10:4318 deploy/nomad/specmesh.nomad.hcl
#   nomad job scale specmesh drafter 4
#
# Secrets come from Nomad Variables, rendered into each task's secrets/ directory and read
# through SPECMESH_*_PASSWORD_FILE (so they never appear in the job or the environment):
#   nomad var put nomad/jobs nats_gateway_password=... nats_tokenizer_password=... \
#     nats_prefill_password=... nats_decode_password=... nats_drafter_password=... \
#     nats_learner_password=... kv_direct_secret=...
# K/V goes from prefill to decode directly (kv_transport "direct": decode pulls a prompt's
# blocks over TCP from the prefill that computed them, on the port Nomad gave that prefill;
# prefill runs on the host's network so the address it serves on is one other hosts reach).
# Through specmesh-infra's valkey instead: -var kv_transport=redis
# -var redis_url=redis://10.0.0.10:6379/0, and redis_password=... in the variables.
# (one NATS user per kind of service, allowed only its own subjects: specmesh-infra's nats.conf)
# Clients need the Docker driver, a host volume "specmesh-models" for the model cache, and
# for the GPU pools the NVIDIA device plugin (device "nvidia/gpu").
#
# Online learning (all but NGRAM): -var speculative_online_learning=true -var learner_count=1
# runs the pool's learner, which trains on what the drafters serve and publishes heads that
# do better; its versions persist in the host volume "specmesh-learner", so a restarted
# pool resumes the latest head.
#
# GPUs: prefill and decode take one each, both in var.dtype (decode reads the K/V prefill
# computed, and refuses K/V of another dtype). Drafters take one only for a model drafter
# (EAGLE, EAGLE3, NEXTN, DFLASH, STANDALONE): local.drafter_gpu follows
# var.speculative_algorithm, and NGRAM (a trie lookup) runs on the CPU with no GPU reserved.

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

variable "image" {
  type        = string
  default     = "specmesh:cpu"
  description = "deploy/Dockerfile built for CPU: gateway, tokenizer"
}

variable "gpu_image" {
  type        = string
  default     = "specmesh:cuda"
  description = "deploy/Dockerfile built with CUDA torch: prefill, decode and drafter"
}

variable "dtype" {
  type        = string
  default     = "bfloat16"
  description = "weights' and K/V's dtype of every pool that holds the model (one for all)"
}

variable "nats_url" {
  type        = string
  description = "every node of specmesh-infra's NATS cluster, comma-separated (a service fails over to the next), e.g. nats://10.0.0.10:4222,nats://10.0.0.11:4222,nats://10.0.0.12:4222 (tls://... for TLS)"
}

variable "kv_transport" {
  type        = string
  default     = "direct"
  description = "how K/V goes from prefill to decode: direct (over TCP, prefill to decode) or redis (through redis_url)"
}

variable "redis_url" {
  type        = string
  default     = ""
  description = "valkey/redis URL of the KV store (kv_transport redis), e.g. redis://10.0.0.10:6379/0"
}

variable "otlp_endpoint" {
  type        = string
  default     = ""
  description = "OTLP/HTTP endpoint of the collector; empty: no traces exported"
}

variable "speculative_algorithm" {
  type    = string
  default = "NGRAM"
}

variable "speculative_draft_model_path" {
  type        = string
  default     = ""
  description = "draft model or EAGLE head under /models; empty: the head shipped for the default model"
}

variable "speculative_online_learning" {
  type        = bool
  default     = false
  description = "drafters send what they serve to the learner (EAGLE, EAGLE3, NEXTN; learner_count 1)"
}

locals {
  drafter_gpu = var.speculative_algorithm != "NGRAM" # a model drafter; NGRAM needs no GPU
}

variable "gateway_count" {
  type    = number
  default = 1
}

variable "tokenizer_count" {
  type    = number
  default = 1
}

variable "prefill_count" {
  type    = number
  default = 1
}

variable "decode_count" {
  type    = number
  default = 2
}

variable "drafter_count" {
  type    = number
  default = 2
}

variable "learner_count" {
  type        = number
  default     = 0
  description = "1 with speculative_online_learning: one learner per pool"
}

job "specmesh" {
  datacenters = var.datacenters
  type        = "service"

  update {
    max_parallel     = 1
    health_check     = "checks"
    min_healthy_time = "10s"
    healthy_deadline = "10m" # the first start fetches the model
  }

  group "gateway" {
    count = var.gateway_count

    network {
      port "http" {
        static = 8000
        to     = 8000
      }
    }

    service {
      name     = "specmesh-gateway"
      provider = "nomad"
      port     = "http"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health" # 503 until a decode worker heartbeats
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    task "gateway" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image   = var.image
        command = "python"
        args    = ["-m", "specmesh.services.gateway"]
        ports   = ["http"]
      }

      env {
        SPECMESH_INSTANCE_ID        = "gateway-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL           = var.nats_url
        SPECMESH_NATS_USER          = "gateway"
        SPECMESH_THREADS            = "1" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NATS_PASSWORD_FILE = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_HOST               = "0.0.0.0"
        SPECMESH_PORT               = "8000"
        OTEL_EXPORTER_OTLP_ENDPOINT = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_gateway_password }}{{ end }}"
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }

  group "tokenizer" {
    count = var.tokenizer_count

    network {
      port "metrics" {
        to = 9100
      }
    }

    service {
      name     = "specmesh-tokenizer"
      provider = "nomad"
      port     = "metrics"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    volume "models" {
      type      = "host"
      source    = "specmesh-models"
      read_only = false
    }

    task "tokenizer" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image   = var.image
        command = "python"
        args    = ["-m", "specmesh.services.tokenizer"]
        ports   = ["metrics"]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
      }

      env {
        SPECMESH_INSTANCE_ID        = "tokenizer-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL           = var.nats_url
        SPECMESH_NATS_USER          = "tokenizer"
        SPECMESH_THREADS            = "1" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NATS_PASSWORD_FILE = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_METRICS_HOST       = "0.0.0.0"
        SPECMESH_METRICS_PORT       = "9100"
        OTEL_EXPORTER_OTLP_ENDPOINT = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_tokenizer_password }}{{ end }}"
      }

      resources {
        cpu    = 1000
        memory = 2048
      }
    }
  }

  group "prefill" {
    count = var.prefill_count

    # The host's network (network_mode below): prefill serves its K/V blocks at the host's
    # own address, on a port Nomad gives it, where decode on other hosts connects.
    network {
      port "metrics" {}
      port "kv" {}
    }

    service {
      name     = "specmesh-prefill"
      provider = "nomad"
      port     = "metrics"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    volume "models" {
      type      = "host"
      source    = "specmesh-models"
      read_only = false
    }

    task "prefill" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image   = var.gpu_image
        command = "python"
        args    = ["-m", "specmesh.services.prefill"]
        ports   = ["metrics", "kv"]

        network_mode = "host"
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
      }

      env {
        SPECMESH_INSTANCE_ID         = "prefill-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL            = var.nats_url
        SPECMESH_NATS_USER           = "prefill"
        SPECMESH_THREADS             = "4" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NATS_PASSWORD_FILE  = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_KV_TRANSPORT        = var.kv_transport
        SPECMESH_KV_DIRECT_HOST      = "${NOMAD_IP_kv}"
        SPECMESH_KV_DIRECT_PORT      = "${NOMAD_PORT_kv}"
        SPECMESH_KV_DIRECT_SECRET_FILE = "${NOMAD_SECRETS_DIR}/kv_direct_secret"
        SPECMESH_REDIS_URL           = var.redis_url
        SPECMESH_REDIS_PASSWORD_FILE = "${NOMAD_SECRETS_DIR}/redis_password"
        SPECMESH_SPECULATIVE_ALGORITHM        = var.speculative_algorithm
        SPECMESH_SPECULATIVE_DRAFT_MODEL_PATH = var.speculative_draft_model_path
        SPECMESH_SPECULATIVE_ONLINE_LEARNING  = var.speculative_online_learning
        SPECMESH_DEVICE              = "cuda"
        SPECMESH_DTYPE               = var.dtype
        SPECMESH_METRICS_HOST        = "0.0.0.0"
        SPECMESH_METRICS_PORT        = "${NOMAD_PORT_metrics}" # the host network: the port Nomad gave
        OTEL_EXPORTER_OTLP_ENDPOINT  = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_prefill_password }}{{ end }}"
      }

      template {
        destination = "secrets/redis_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .redis_password }}{{ end }}"
      }

      template {
        destination = "secrets/kv_direct_secret"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .kv_direct_secret }}{{ end }}"
      }

      resources {
        cpu    = 4000
        memory = 8192

        device "nvidia/gpu" {
          count = 1
        }
      }
    }
  }

  group "decode" {
    count = var.decode_count

    network {
      port "metrics" {
        to = 9100
      }
    }

    service {
      name     = "specmesh-decode"
      provider = "nomad"
      port     = "metrics"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    volume "models" {
      type      = "host"
      source    = "specmesh-models"
      read_only = false
    }

    task "decode" {
      driver       = "docker"
      kill_timeout = "30s" # SIGTERM: no new requests, those in flight finish (--drain-timeout)

      config {
        image   = var.gpu_image
        command = "python"
        args    = ["-m", "specmesh.services.decode"]
        ports   = ["metrics"]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
      }

      env {
        SPECMESH_INSTANCE_ID           = "decode-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL              = var.nats_url
        SPECMESH_NATS_USER             = "decode"
        SPECMESH_THREADS               = "4" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NATS_PASSWORD_FILE    = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_KV_TRANSPORT          = var.kv_transport
        SPECMESH_KV_DIRECT_SECRET_FILE = "${NOMAD_SECRETS_DIR}/kv_direct_secret"
        SPECMESH_REDIS_URL             = var.redis_url
        SPECMESH_REDIS_PASSWORD_FILE   = "${NOMAD_SECRETS_DIR}/redis_password"
        SPECMESH_SPECULATIVE_ALGORITHM = var.speculative_algorithm
        SPECMESH_SPECULATIVE_DRAFT_MODEL_PATH = var.speculative_draft_model_path
        SPECMESH_SPECULATIVE_ONLINE_LEARNING  = var.speculative_online_learning
        SPECMESH_DEVICE                = "cuda"
        SPECMESH_DTYPE                 = var.dtype
        SPECMESH_METRICS_HOST          = "0.0.0.0"
        SPECMESH_METRICS_PORT          = "9100"
        OTEL_EXPORTER_OTLP_ENDPOINT    = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_decode_password }}{{ end }}"
      }

      template {
        destination = "secrets/redis_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .redis_password }}{{ end }}"
      }

      template {
        destination = "secrets/kv_direct_secret"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .kv_direct_secret }}{{ end }}"
      }

      resources {
        cpu    = 4000
        memory = 16384

        device "nvidia/gpu" {
          count = 1
        }
      }
    }
  }

  group "drafter" {
    count = var.drafter_count

    network {
      port "metrics" {
        to = 9100
      }
    }

    service {
      name     = "specmesh-drafter"
      provider = "nomad"
      port     = "metrics"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    volume "models" {
      type      = "host"
      source    = "specmesh-models"
      read_only = false
    }

    task "drafter" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image   = var.gpu_image
        command = "python"
        args    = ["-m", "specmesh.services.drafter"]
        ports   = ["metrics"]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
      }

      env {
        SPECMESH_INSTANCE_ID           = "drafter-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL              = var.nats_url
        SPECMESH_NATS_USER             = "drafter"
        SPECMESH_THREADS               = "2" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NATS_PASSWORD_FILE    = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_SPECULATIVE_ALGORITHM = var.speculative_algorithm
        SPECMESH_SPECULATIVE_DRAFT_MODEL_PATH = var.speculative_draft_model_path
        SPECMESH_SPECULATIVE_ONLINE_LEARNING  = var.speculative_online_learning
        SPECMESH_DEVICE                = local.drafter_gpu ? "cuda" : "cpu"
        SPECMESH_DTYPE                 = var.dtype
        SPECMESH_METRICS_HOST          = "0.0.0.0"
        SPECMESH_METRICS_PORT          = "9100"
        OTEL_EXPORTER_OTLP_ENDPOINT    = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_drafter_password }}{{ end }}"
      }

      resources {
        cpu    = 2000
        memory = 8192

        dynamic "device" { # a GPU for a model drafter only
          for_each = local.drafter_gpu ? ["nvidia/gpu"] : []
          labels   = [device.value]
          content {
            count = 1
          }
        }
      }
    }
  }

  group "learner" {
    count = var.learner_count

    network {
      port "metrics" {
        to = 9100
      }
    }

    service {
      name     = "specmesh-learner"
      provider = "nomad"
      port     = "metrics"
      tags     = ["specmesh", "metrics"]

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    volume "models" {
      type      = "host"
      source    = "specmesh-models"
      read_only = false
    }

    volume "learner" { # head versions and held-out examples: a restart resumes them
      type      = "host"
      source    = "specmesh-learner"
      read_only = false
    }

    task "learner" {
      driver       = "docker"
      kill_timeout = "30s"

      config {
        image   = var.image
        command = "python"
        args    = ["-m", "specmesh.services.learner"]
        ports   = ["metrics"]
      }

      volume_mount {
        volume      = "models"
        destination = "/models"
      }

      volume_mount {
        volume      = "learner"
        destination = "/learner"
      }

      env {
        SPECMESH_INSTANCE_ID             = "learner-${NOMAD_SHORT_ALLOC_ID}"
        SPECMESH_NATS_URL                = var.nats_url
        SPECMESH_NATS_USER               = "learner"
        SPECMESH_THREADS                 = "1" # as many as its reserved cpu (MHz / 1000)
        SPECMESH_NICE                    = "19" # trains on what serving leaves idle
        SPECMESH_NATS_PASSWORD_FILE      = "${NOMAD_SECRETS_DIR}/nats_password"
        SPECMESH_SPECULATIVE_ALGORITHM   = var.speculative_algorithm
        SPECMESH_SPECULATIVE_DRAFT_MODEL_PATH = var.speculative_draft_model_path
        SPECMESH_SPECULATIVE_ONLINE_DIR  = "/learner"
        SPECMESH_METRICS_HOST            = "0.0.0.0"
        SPECMESH_METRICS_PORT            = "9100"
        OTEL_EXPORTER_OTLP_ENDPOINT      = var.otlp_endpoint
      }

      template {
        destination = "secrets/nats_password"
        change_mode = "restart"
        data        = "{{ with nomadVar \"nomad/jobs\" }}{{ .nats_learner_password }}{{ end }}"
      }

      resources {
        cpu    = 1000
        memory = 4096
      }
    }
  }
}
