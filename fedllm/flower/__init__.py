"""Cross-silo federation on Flower: the same server and client runtime, one real site per SuperNode.

``server_app.py`` runs fedllm's :class:`~fedllm.server.Server` round loop as a
Flower ServerApp (:class:`FlowerDriver`), ``client_app.py`` runs one
:class:`~fedllm.flower.site.Site` per SuperNode. Only ClientStart and
ClientUpdate cross, as Flower records (``records.py``); the base model and the
data never leave a site.
"""
