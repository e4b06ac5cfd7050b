"""The Serve deployment: a checkpoint's model on one device per replica, answering next-token requests in batches.

Imports Ray: import it only where Ray may be (after the cluster's environment is set, see ``serving/app.py``).
"""

from __future__ import annotations

import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from hetero_ray.cluster.emulation import GPU_TYPE_LABEL
from hetero_ray.serving.model import Answer, ServeError, load_predictor

# Concurrent requests one forward answers at most, and how long the first of them waits for company.
MAX_BATCH = 16
BATCH_WAIT_S = 0.02
DEPLOYMENT = "NextByteServer"


@serve.deployment(name=DEPLOYMENT, max_ongoing_requests=2 * MAX_BATCH)
class NextByteServer:
    """``POST {"text": "..."}`` (or ``{"tokens": [...]}``) → the most likely next token and its probability;
    ``GET`` → what this replica serves and where. The checkpoint is loaded once, when the replica starts."""

    def __init__(self, checkpoint: str):
        self.predictor = load_predictor(checkpoint, "cuda" if torch.cuda.is_available() else "cpu")
        context = ray.get_runtime_context()
        self.where = {
            "gpu_type": context.get_node_labels().get(GPU_TYPE_LABEL),
            "node_id": context.get_node_id(),
            "replica": serve.get_replica_context().replica_id.unique_id,
        }

    async def __call__(self, request: Request) -> JSONResponse:
        p = self.predictor
        if request.method == "GET":
            info = {"workload": p.workload, "step": p.step, "context": p.context, "vocab": p.vocab}
            return JSONResponse({**info, **self.where})
        try:
            tokens = p.tokens(await request.json())
        except ServeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except ValueError:  # json.JSONDecodeError
            return JSONResponse({"error": "the request body is not JSON"}, status_code=400)
        answer, batch_size = await self.predict(tokens)
        out = {"token": answer.token, "probability": answer.probability}
        if p.byte_level:
            out["text"] = bytes([answer.token]).decode("utf-8", errors="replace")
        return JSONResponse({**out, "batch_size": batch_size, **self.where})

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)
    async def predict(self, requests: list[list[int]]) -> list[tuple[Answer, int]]:
        """Every request waiting now, in one call: ``Predictor.predict`` groups them by length, so each answer is
        the one its request gets alone."""
        answers = self.predictor.predict(requests)
        return [(a, len(requests)) for a in answers]
