"""The cluster configuration file of `probserve serve --ray --cluster-config FILE` (YAML or
JSON): which models, how many replicas of each (fixed, or autoscaled), where they may run and how
much each may queue. Without a file, each `--model` gets one deployment of `--replicas` replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from probserve.settings import ServeSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Autoscaling(_Strict):
    """Ray Serve's autoscaler: replicas between the bounds, aiming at this many requests in
    flight per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)


class ModelDeployment(_Strict):
    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    draft_model: str | None = None  # `speculative: draft`'s draft model (engine's setting)
    num_replicas: int = Field(1, ge=1)  # ignored with autoscaling
    autoscaling: Autoscaling | None = None
    max_ongoing_requests: int = Field(64, ge=1)  # per replica: what its engine batches
    max_queued_requests: int = Field(256, ge=1)  # waiting for a replica; past it: 429
    num_cpus: float = Field(1.0, ge=0)  # per replica (fractions share a core)
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, to pin
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig fields for this model


class IngressDeployment(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)


class ClusterConfig(_Strict):
    address: str | None = None  # a Ray cluster to join ("auto", "HOST:PORT"); None: start one
    app_name: str = "probserve"
    retries: int = Field(3, ge=0)  # replicas a request may move to after a failure
    # seconds the application may take to be running (replicas scheduled, models loaded) before
    # `probserve serve --ray` gives up and exits 1 with the deployments' status; 0: no limit
    start_timeout: float = Field(900.0, ge=0)
    ingress: IngressDeployment = Field(default_factory=IngressDeployment)
    models: list[ModelDeployment]

    @model_validator(mode="after")
    def _names_distinct(self) -> ClusterConfig:
        names = [m.served_model_name or m.model for m in self.models]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"models must be given, each with a distinct name: {names}")
        return self


def load_cluster_config(settings: ServeSettings) -> ClusterConfig:
    """The file of `--cluster-config`, else one deployment per `--model` with `--replicas` replicas;
    `--ray-address` overrides the file's address."""
    flags = settings.flags
    if flags.cluster_config:
        data = yaml.safe_load(Path(flags.cluster_config).read_text(encoding="utf-8")) or {}
        config = ClusterConfig.model_validate(data)
    else:
        models = [
            ModelDeployment(
                model=m.spec,
                served_model_name=m.served_name,
                draft_model=m.draft,
                num_replicas=flags.replicas,
            )
            for m in settings.models
        ]
        config = ClusterConfig(models=models)
    if flags.ray_address:
        config = config.model_copy(update={"address": flags.ray_address})
    return config
