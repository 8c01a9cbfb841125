"""The worker half of KVSMConnector (``WorkerHalf``), one module per concern:

``context``   the shared state, the results box, applying events (follow-ups)
``recv``      the receiving side (decode): requests, reads, their effects
``send``      the sending side (prefill): pins, leases, claims answered
``peers``     peers (the ``peer`` lifecycle) and claims, heartbeats, abandons
``recovery``  an exception on the loop fails only the request it was for
``half``      ``WorkerHalf`` itself: start, submit, shutdown, introspection

Nothing here imports vLLM: the worker, the simulation and the load tests run
without it.
"""

from kvsm.worker.half import WorkerHalf

__all__ = ["WorkerHalf"]
