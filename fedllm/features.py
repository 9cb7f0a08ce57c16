"""The cross-cutting features, each in a room of its own (see :class:`fedllm.protocol.Feature`).

The config layer collects their sections and rules from this list, and the assembly lets each one hook
the strategy, the server's policy and sampling, and the clients' uploads. Nothing else imports a feature.
"""

from __future__ import annotations

from fedllm.privacy import PRIVACY
from fedllm.protocol import Feature
from fedllm.secagg import SECAGG
from fedllm.transport import TRANSPORT

# in order: uploads are clipped and noised, then made a secure summand or encoded
FEATURES: list[Feature] = [PRIVACY, SECAGG, TRANSPORT]
