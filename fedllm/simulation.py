"""The in-process driver: every client simulated by this job, on one base per process.

The round loop is :class:`~fedllm.round_loop.RoundLoop`'s; this driver says
where clients train (the local :class:`~fedllm.client.runtime.ClientRuntime`)
and builds its pieces with :func:`fedllm.assembly.assemble`. The processes of
an ``accelerate launch`` share the work as ``fedllm/model/parallel.py`` says: clients
split over processes (every process then aggregates the same sorted list), or
every process on every client with the batches split (data layout).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedllm import assembly
from fedllm.client.runtime import ClientData
from fedllm.client.store import ClientStore
from fedllm.config import Config, token_modules
from fedllm.logs import client_label, names_clients, redact
from fedllm.round_loop import RoundLoop, personal_summary
from fedllm.server import RoundPlan

log = logging.getLogger(__name__)
SMALL_TEST = 20  # a client's held-out set smaller than this: its accuracy is said to mean little


class Simulation(RoundLoop):
    """Every client simulated by this job (see module docstring).

    ``federation`` gives prebuilt pieces (benchmarks on in-memory models) instead of :meth:`setup`'s.
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        accelerator=None,
        federation: assembly.Federation | None = None,
    ):
        super().__init__(cfg, run_dir, accelerator)
        if federation is not None:
            self._use(federation)

    def setup(self) -> None:
        shared = token_modules(self.cfg)
        if shared and self.acc.is_main_process:
            log.warning(
                "lora.trainable_modules shares %s: the rows a client changes are the tokens of its data, "
                "which a federation across organizations would reveal (the Flower driver refuses this unless "
                "flower.share_token_modules=true)",
                shared,
            )
        self._use(assembly.assemble(self.cfg, self.acc, progress=self.bars_disabled() is None))

    def _use(self, fed: assembly.Federation) -> None:
        self.server, self.runtime, self.clients = fed.server, fed.runtime, fed.clients
        # in the data layout every process trains every client: the main process writes its state
        writes = not fed.runtime.layout.data_parallel or self.acc.is_main_process
        self.store = ClientStore(self.run_dir / "clients", writes=writes)
        self.eval_data, self.benchmark, self.partition_stats = (
            fed.eval_data,
            fed.benchmark,
            fed.partition_stats,
        )
        self.generation, self.general = fed.generation, fed.general
        self._evaluator = None  # built again from what was just set (RoundLoop.evaluator)
        tests = [s["test"] for s in self.partition_stats if isinstance(s.get("test"), int)]
        if self.cfg.eval.personalized and tests and min(tests) < SMALL_TEST and self.acc.is_main_process:
            log.warning(
                "clients' own held-out sets are small (as few as %d examples, under %d): their global and "
                "personalized accuracies move in steps of 1/%d and mean little; raise "
                "data.client_test_fraction or give clients more data",
                min(tests),
                SMALL_TEST,
                max(1, min(tests)),
            )

    def local_clients(self) -> list[ClientData]:
        return self.clients

    def train_clients(self, plan: RoundPlan) -> dict[int, Any]:
        """Train this process's share of the round; each client's state is read from its file first and
        written back (a new version) after, so only the round's clients are ever in memory."""
        layout = self.runtime.layout
        results: list[tuple[int, Any, bool]] = []
        mine = layout.my_clients(plan.active)
        self.runtime.clients_per_round = len(plan.active)  # many: per-client lines at DEBUG
        together = self.cfg.federation.client_batch  # clients trained in one forward (client/batched.py)
        bar = tqdm(
            total=len(mine), desc=f"round {plan.round} clients", leave=False, disable=self.bars_disabled()
        )
        for start in range(0, len(mine), together):
            group = mine[start : start + together]
            for k in group:
                self.store.load(self.clients[k])
            # one client alone, or several in one forward when they can be (client/batched.py)
            got = self.runtime.train_many([self.clients[k] for k in group], [plan.starts[k] for k in group])
            for k, g in zip(group, got, strict=True):
                if isinstance(g, Exception):  # a faulty client must not take the round down
                    log.warning("round %d: %s left out: %s", plan.round, client_label(k), redact(str(g)))
                    if names_clients():  # a traceback carries the failure's own words, which may name it
                        log.debug("%s: traceback", client_label(k), exc_info=(type(g), g, g.__traceback__))
                    g = f"{type(g).__name__}: {g}"
                results.append((k, g, self.store.save(self.clients[k], plan.round)))
                self.store.release(self.clients[k])
            bar.update(len(group))
        bar.close()
        if layout.data_parallel and self.acc.num_processes > 1:
            self.acc.wait_for_everyone()  # the main process's state files exist before anyone reads them
        results = self._gather(results)
        for k, _, has_state in results:  # every process indexes every client (it may train it next round)
            self.store.trained(k, plan.round, has_state)
        return {k: got for k, got, _ in results}

    def _gather(self, results: list) -> list:
        if not self.runtime.layout.gathers:  # one process, or data mode: every process has every result
            return results
        from accelerate.utils import gather_object

        return sorted((r for part in gather_object([results]) for r in part), key=lambda r: r[0])

    def personalized(self, round_idx: int, clients: list[int]) -> dict[str, Any]:
        """Each of ``clients``' test data: the global model, then its personalization
        (ClientRuntime.personalized)."""
        from eval.progress import Progress

        layout = self.runtime.layout
        rows = {}
        mine = [c for c in layout.my_clients([self.clients[k] for k in clients]) if c.test]
        with Progress(
            len(mine), "clients' own held-out data", "clients", self.bars_disabled() is None, log
        ) as bar:
            for client in mine:
                self.store.load(client)
                start = self.server.client_start(round_idx + 1, client.client_id)
                rows[str(client.client_id)] = self.runtime.personalized(
                    client, start, self.cfg.eval.batch_size
                )
                self.store.release(client)
                bar.update()
        if layout.gathers:
            from accelerate.utils import gather_object

            rows = {k: v for part in gather_object([rows]) for k, v in part.items()}
        return personal_summary(rows)
