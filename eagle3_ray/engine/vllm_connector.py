"""The KV connector that hands vLLM's captured hidden states to eagle3_ray (engine/vllm.py).

vLLM's `extract_hidden_states` method stores the aux layers and the final state of every prompt
token in a cache-only KV layer; a KV connector takes them out. The stock
`ExampleHiddenStatesConnector` does that after a request finishes, with an async CUDA copy into
pinned memory: on the CPU build its first finished request kills the engine (`RuntimeError:
pin_memory=True requires a CUDA or other accelerator backend`), and it writes the file one
engine step later, after `LLM.generate` has returned. This one writes at the end of the very
forward that computed the states, with a plain copy, so the file is complete when the request's
output comes back, on CPU and GPU alike (tensor-parallel rank 0 writes; ranks share the node).

It needs each prompt's whole prefill in one step: the engine runs without chunked prefill
(VllmVerifier does that). Hand-over (`handoff` in kv_connector_extra_config):
  memory  the engine runs in the reader's own process (one worker, in-process engine core): the
          states go into RECEIVED, keyed by request id, and the reader pops them. No file.
  files   worker processes (tensor parallel): a safetensors file per request in the
          `shared_storage_path` the engine is given (a private temporary directory); the reader
          deletes each one as soon as it has read it.

Loaded by vLLM from `kv_connector_module_path`, in vLLM's own environment only:

    .venv-vllm/bin/python -m eagle3_ray.engine.vllm --check \
        "$(.venv/bin/python -m eagle3_ray.engine.hf --materialize)"   # extracts 2 prompts with it
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, ExampleHiddenStatesConnectorMetadata, PendingSave,
    extract_from_kv_cache)

RECEIVED: dict[str, dict] = {}   # handoff "memory": request id -> {"hidden_states", "token_ids"}


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """Saves each new request's prompt hidden states [T, layers, H] in the step that prefills it."""

    def build_connector_meta(self, scheduler_output):
        """Scheduler side: every request scheduled for the first time is saved in this step."""
        meta = ExampleHiddenStatesConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            n = len(req.prompt_token_ids)
            if req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id] != n:
                raise RuntimeError(f"request {req.req_id}: its prompt of {n} tokens is prefilled "
                                   "over several steps; run the engine with "
                                   "enable_chunked_prefill=False and max_num_batched_tokens >= "
                                   "max_model_len")
            path = os.path.join(self._storage_path, f"{req.req_id}.safetensors")
            self._request_filenames[req.req_id] = path
            blocks = list(req.block_ids[self._cache_kv_group_id])
            meta.pending_saves.append(PendingSave(req.req_id, path,
                                                  torch.tensor(req.prompt_token_ids), blocks))
        return meta

    def _in_memory(self) -> bool:
        return self._kv_transfer_config.get_from_extra_config("handoff", "files") == "memory"

    def request_finished(self, request, block_ids):
        """Saved already: free the blocks now, and tell the client where the states are."""
        path = self._request_filenames.pop(request.request_id, None)
        if path is None:
            return False, None
        if self._in_memory():
            return False, {"hidden_states_request": request.request_id}
        return False, {"hidden_states_path": path}

    def wait_for_save(self):
        """Worker side, after the forward: copy each new request's slots out and write them."""
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        for p in self._get_connector_metadata().pending_saves:
            blocks = torch.tensor(p.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size)[None, :]
                     + blocks[:, None] * self._block_size).flatten()            # [blocks*size]
            states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                           len(p.token_ids))                    # [T, layers, H]
            got = {"hidden_states": states.cpu().clone(), "token_ids": p.token_ids}
            if self._in_memory():
                RECEIVED[p.req_id] = got
                continue
            tmp = p.filename + ".tmp"
            save_file(got, tmp)
            os.replace(tmp, p.filename)

    def get_finished(self, finished_req_ids):
        return None, None                 # nothing in flight: wait_for_save wrote synchronously
