"""An OpenAI-compatible agent gateway (issue #18): any agent program that talks to an OpenAI
server runs unchanged against the policy's engine, and its episodes become training rows.

- server.py:   the HTTP server (/v1/chat/completions, /v1/completions, /v1/models)
- record.py:   what each call records, the episodes, and how a call's prompt tokens are built
- batcher.py:  concurrent calls generated as one engine batch
- episodes.py: running the program G times per example, and its episodes as one Rollout
The workload that trains on them is grouprl/workloads/gateway.py (`workload: {type: gateway}`).
"""

from grouprl.rollouts.gateway.record import Call, EpisodeLog, EpisodeStore, GatewayError
from grouprl.rollouts.gateway.server import EPISODE_HEADER, Gateway

__all__ = ["EPISODE_HEADER", "Call", "EpisodeLog", "EpisodeStore", "Gateway", "GatewayError"]
