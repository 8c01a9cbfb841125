"""The worker half of KVSMConnector (``WorkerHalf``): a composition of parts,
one module per concern, each handed what it needs:

``context``    the state every part shares, the results box, the outcome listener
``runner``     the one effect runner: step a tracker, carry out its effects
``recv``       the receiving part (decode): requests and their effects
``reads``      reads in flight: polled until they settle, stalls probed
``recv_plan``  which prefill workers a request reads, and what (no I/O)
``send``       the sending part (prefill): pins, leases, claims answered
``peers``      peers (the ``peer`` lifecycle) and claims, heartbeats, abandons
``recovery``   an exception on the loop fails only the request it was for
``half``       ``WorkerHalf`` itself: start, submit, shutdown, introspection

Nothing here imports vLLM: the worker, the simulation and the load tests run
without it.
"""

from kvsm.worker.half import WorkerHalf

__all__ = ["WorkerHalf"]
