"""The Flower ClientApp: one site's runtime behind ``query`` (handshake), ``train`` and ``evaluate``.

A SuperNode is started per site with ``--node-config "client-id=K
data-path=FILE state-dir=DIR [model-path=PATH] [sign-key=NODE_KEY]"`` (``sign-key``: the private key
the SuperNode authenticates with, which signs every reply; ``secure-aggregation='required'``: the site
refuses any plain train message, so that no server can have its update in the clear); on the Simulation
Engine the
node's ``partition-id`` is the client id and its data is rebuilt from the run's
config. The client state travels between the messages of a SuperNode in
``context.state`` and is written to ``state-dir`` after every message.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedllm.features import FEATURES
from fedllm.flower.node import pinned_secure, signing_key
from fedllm.flower.records import (
    evaluation_record,
    info_record,
    read_info,
    read_start,
    signed,
    start_config,
    update_record,
)
from fedllm.flower.site import Site, round_terms, site_for
from fedllm.logs import setup_logging

log = logging.getLogger(__name__)
STATE_KEY = "fedllm-client-state"

app = ClientApp()


def _site(context: Context, config_text: str) -> Site:
    setup_logging(os.environ.get("FEDLLM_LOG_LEVEL", "INFO"))
    site = site_for(config_text, context.node_config, context.run_id)
    if STATE_KEY in context.state:
        site.use_state(dict(context.state[STATE_KEY].to_torch_state_dict()))
    return site


def _keep_state(context: Context, site: Site) -> None:
    context.state[STATE_KEY] = ArrayRecord(torch_state_dict=dict(site.client.state))


@app.query()
def query(message: Message, context: Context) -> Message:
    """The handshake: which client this node is and how many examples it trains on."""
    _, config_text = read_info(message.content)
    site = _site(context, config_text)
    reply = signed(info_record(site.info()), signing_key(context.node_config), message.metadata.message_id)
    return Message(reply, reply_to=message)


# what a feature's mod may do with a message's site (secure aggregation trains it in the protocol's stage)
SITES = SimpleNamespace(
    site=lambda context, config_text: _site(context, config_text),
    keep=lambda c, s: _keep_state(c, s),
    round_terms=round_terms,  # a secure round's statement: the start the rule gives, under the config sent
)


@app.train(mods=[mod for feature in FEATURES for mod in feature.client_mods(SITES)])  # secure aggregation's
def train(message: Message, context: Context) -> Message:
    if pinned_secure(context.node_config):
        # the site's own pin: a server that asks for a plain round would get its update in the clear
        raise RuntimeError(
            "this site requires secure aggregation (node-config secure-aggregation='required'): it refuses a "
            "plain train message"
        )
    config_text, client_id = start_config(message.content)
    site = _site(context, config_text)
    if site.client_id != client_id:
        raise RuntimeError(f"message for client {client_id} reached the site of client {site.client_id}")
    update = site.train(read_start(message.content, site.codecs))
    _keep_state(context, site)
    reply = update_record(update, site.codecs)
    reply = signed(reply, signing_key(context.node_config), message.metadata.message_id)
    return Message(reply, reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """The site's personalized evaluation of the global model it is sent (its own test data)."""
    config_text, _ = start_config(message.content)
    site = _site(context, config_text)
    row = site.personalized(read_start(message.content, site.codecs))
    _keep_state(context, site)
    metrics = {k: float(v) for k, v in row.items() if v is not None}
    reply = signed(evaluation_record(metrics), signing_key(context.node_config), message.metadata.message_id)
    return Message(reply, reply_to=message)
