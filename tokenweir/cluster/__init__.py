"""Multi-replica serving on Ray: `tokenweir serve --data-parallel-size N`.

routing.py     which replica a request goes to (pure Python, no torch and no Ray)
dispatch.py    one dispatch round from the global queue (shared with the simulator's cluster)
config.py      ClusterConfig: the flags of the cluster
replica.py     EngineReplica: one engine and its loop in a Ray actor process
stats.py       one SchedulerStats for the server's metrics from the replicas' own
coordinator.py ClusterEngine: the global queue, dispatch, failover; the server's EngineClient
"""

import os

# Ray on loopback only, and no usage reports (../shared/STACK.md). Ray reads the first when its
# constants are first imported, so it is set here, before anything of this package imports Ray.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
for _name, _value in RAY_ENV.items():
    os.environ.setdefault(_name, _value)
