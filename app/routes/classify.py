"""POST /classify: the fine-tuned task head of the checkpoint (model/task_head.py, `python -m training.finetune`),
when it has one; 404 with a clear message when it has none."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.errors import ApiError, error_responses, invalid
from app.guards import StrictJSONRoute, json_only
from app.protocol.common import STRICT
from app.routes import ServiceDep, authorized
from app.service import engine_error
from engine.client import EngineError
from engine.request import ErrorKind
from model.task_items import item_error

router = APIRouter(route_class=StrictJSONRoute, tags=["Tasks"], dependencies=[Depends(json_only), Depends(authorized)])
MAX_ITEMS = 64


class ClassifyRequest(BaseModel):
    model_config = STRICT
    inputs: Any = Field(description="one item or a list of up to 64: classification a string; entailment "
                        "{premise, hypothesis} or a pair; similarity {text_a, text_b} or a pair; multiple_choice "
                        "{context, answers: [...]}")


class LabelScore(BaseModel):
    label: str = Field(description="a label name, or the answer index for multiple choice")
    score: float


@router.post("/classify", summary="Label probabilities from the checkpoint's fine-tuned task head "
             "(404 when it has none)", response_model=list[LabelScore] | list[list[LabelScore]],
             responses=error_responses(400, 401, 404, 413, 415, 422, 503))
async def classify(body: ClassifyRequest, service: ServiceDep) -> list:
    service.check_open()
    task = service.task
    if task is None:
        raise ApiError(404, "this checkpoint has no task head: /classify needs a checkpoint fine-tuned with "
                            "python -m training.finetune", "not_found")
    kind = task["kind"]
    batch = isinstance(body.inputs, list) and not (kind in ("entailment", "similarity")
                                                   and len(body.inputs) == 2 and all(isinstance(x, str)
                                                                                     for x in body.inputs))
    items = body.inputs if batch else [body.inputs]
    if not items:
        raise invalid("inputs", "must not be empty")
    if len(items) > MAX_ITEMS:
        raise invalid("inputs", f"at most {MAX_ITEMS} items per request, got {len(items)}")
    for i, item in enumerate(items):
        if (err := item_error(kind, item)) is not None:
            raise invalid(f"inputs.{i}" if batch else "inputs", f"{err} (a {kind} task)")
    try:  # computed by the engine core, which holds the model
        probs = await service.engine.classify(items)
    except EngineError as e:
        if e.kind == ErrorKind.INVALID:
            raise invalid("inputs", e.message) from None
        raise engine_error(e) from None
    ranked = [[{"label": k, "score": v} for k, v in sorted(p.items(), key=lambda kv: -kv[1])] for p in probs]
    return ranked if batch else ranked[0]
