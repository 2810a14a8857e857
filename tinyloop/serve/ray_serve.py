"""Ray Serve across hosts: a deployment whose every replica is a :class:`Replica` (the ``ray``
extra: ``pip install 'tinyloop[ray]'``).

``ray_app(model, replicas=N)`` builds the application (``serve.run(ray_app(...))``; ``tinyloop
serve --ray``): N Ray actors, each loading the model and serving the same OpenAI-compatible
Starlette app as a ``tinyloop serve`` worker (the app is the deployment's ASGI ingress). On
the cuda backend each actor takes one GPU (``ray_actor_options={"num_gpus": 1}``: Ray sets
its CUDA_VISIBLE_DEVICES before the actor's code, so CuPy sees that GPU only); on the numpy
backend a CPU. Ray's proxy routes the requests (its default router: the less loaded of two
replicas drawn at random) and restarts a replica whose actor dies or whose health check
(the engine is running) fails; the prefix affinity of ``tinyloop.serve.router`` is not
applied here. A replica's ``__del__`` stops its engine and frees its model.
"""

from __future__ import annotations

from ..errors import ConfigError
from .replica import Replica, ReplicaSpec


class ReplicaDeployment:
    """The deployment's class (wrapped by ``serve.ingress`` in :func:`deployment`): one
    :class:`Replica` per actor, its app the ingress."""

    def __init__(self, spec_json: str):
        self.replica = Replica(ReplicaSpec.from_json(spec_json))

    def __serve_build_asgi_app__(self):
        return self.replica.app

    def check_health(self) -> None:
        """Ray Serve's health check: raises while the engine is not running."""
        eng = self.replica.engine
        if eng is None or not eng.running:
            raise RuntimeError("the replica's engine is not running")

    def __del__(self):
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.close()


def deployment(spec: ReplicaSpec, replicas: int = 1, *, num_gpus=None, num_cpus: float = 1,
               name: str = "tinyloop"):
    """The Ray Serve Deployment of ``replicas`` :class:`ReplicaDeployment` actors;
    ``num_gpus`` per actor (None: 1 unless the backend is numpy, then 0). ConfigError for
    bad counts."""
    from ray import serve
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an int >= 1, got {replicas!r}")
    if num_gpus is None:
        num_gpus = 0 if spec.backend == "numpy" else 1
    if num_gpus < 0 or num_cpus < 0:
        raise ConfigError(f"num_gpus and num_cpus must be >= 0, got {num_gpus}, {num_cpus}")
    cls = serve.ingress()(ReplicaDeployment)
    return serve.deployment(
        cls, name=name, num_replicas=replicas,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
        # the engine queues what it cannot batch; Ray's own queue holds the rest
        max_ongoing_requests=spec.max_batch + spec.max_queue)


def ray_app(model, replicas: int = 1, *, backend: str = "auto", num_gpus=None,
            num_cpus: float = 1, **spec_kw):
    """The bound Ray Serve application of ``replicas`` replicas of ``model`` (a .tlm path,
    or a :class:`ReplicaSpec`; ``spec_kw`` are ReplicaSpec's other fields): pass it to
    ``ray.serve.run``. Raises ConfigError for a bad spec or count, ImportError without Ray."""
    spec = model if isinstance(model, ReplicaSpec) else ReplicaSpec(model=str(model),
                                                                     backend=backend,
                                                                     **spec_kw)
    return deployment(spec, replicas, num_gpus=num_gpus, num_cpus=num_cpus).bind(
        spec.to_json())


def serve_ray(spec: ReplicaSpec, replicas: int, host: str = "127.0.0.1",
              port: int = 8000, address: str | None = None) -> None:
    """``tinyloop serve --ray``: connect to the Ray cluster at ``address`` (None: start a
    local one), run the application with Ray's HTTP proxy on ``host``:``port`` until
    interrupted, then shut Serve down."""
    import time

    import ray
    from ray import serve
    ray.init(address=address or "local", include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(ray_app(spec, replicas), name="tinyloop", route_prefix="/")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
