"""A CPU stand-in for the three FlashInfer wrappers the ``flashinfer`` backend uses.

It exists to test our adapter (page tables from the request-slot table, padding rows, the
CUDA-graph buffers and re-planning) where FlashInfer cannot run; it is no evidence about
FlashInfer's kernels, which the GPU tests (marker ``gpu``) check against torch_native on a GPU.

What it mirrors of flashinfer-python 0.7.2 (``decode.py`` / ``prefill.py``; see
docs/flashinfer.md): the constructor and ``plan`` parameter names we pass (an unknown or
misspelled keyword is a ``TypeError`` here as there), paged KV ``(k, v)`` of shape
``(pages, page_size, kv_heads, head_dim)`` in ``NHD``, int32 CSR page tables,
``last_page_len``, causal masks aligned to the end of the KV (a continuing sequence's new
tokens see its prefix), and CUDA-graph mode: a batch size fixed by the buffers given at
construction, ``plan`` copying into those buffers, ``run`` reading them. It also insists on
what we promise and FlashInfer would only pay for: ``indptr`` / ``last_page_len`` on the
host (a device tensor there costs a device-to-host sync at every plan).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__version__ = "0.0.0+fake"

PLANS: list[dict[str, Any]] = []  # every plan, for tests that count them


class _Paged:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, backend: str = "auto",
                 indptr_buf: torch.Tensor | None = None,
                 indices_buf: torch.Tensor | None = None,
                 last_page_len_buf: torch.Tensor | None = None) -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        if kv_layout != "NHD":
            raise ValueError(f"fake supports NHD only, not {kv_layout}")
        self.backend = backend
        self.graph = use_cuda_graph
        if use_cuda_graph:
            for name, buf in (("indptr", indptr_buf), ("indices", indices_buf),
                              ("last_page_len", last_page_len_buf)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} buffer should be a torch.Tensor in cudagraph mode")
            assert last_page_len_buf is not None and indptr_buf is not None
            self.fixed_batch = len(last_page_len_buf)
            if len(indptr_buf) != self.fixed_batch + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.indptr, self.indices, self.last = indptr_buf, indices_buf, last_page_len_buf
        self.qo_indptr: torch.Tensor | None = None
        self.causal = False
        self.scale = 1.0

    def _plan_pages(self, indptr: torch.Tensor, indices: torch.Tensor,
                    last_page_len: torch.Tensor, page_size: int, sm_scale: float | None,
                    head_dim: int, q_data_type: torch.dtype,
                    kv_data_type: torch.dtype | None) -> None:
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu", \
            "indptr/last_page_len on the device: FlashInfer would sync to read them"
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert isinstance(q_data_type, torch.dtype) and kv_data_type in (None, q_data_type)
        assert page_size == 1, "the executor's pools are page size 1"
        batch = len(last_page_len)
        assert len(indptr) == batch + 1 and int(indptr[-1]) == len(indices)
        if self.graph:
            if batch != self.fixed_batch:
                raise ValueError(f"The batch size should be fixed in cudagraph mode: {batch} "
                                 f"!= {self.fixed_batch}")
            assert self.indptr is not None and self.indices is not None
            assert self.last is not None
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), \
                last_page_len.clone()
        self.scale = sm_scale if sm_scale is not None else head_dim**-0.5
        PLANS.append({"wrapper": self, "batch": batch})

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
        assert self.indptr is not None and self.indices is not None and self.last is not None
        indptr, last = self.indptr.tolist(), self.last.tolist()
        batch = len(last)
        qo = self.qo_indptr.tolist() if self.qo_indptr is not None else list(range(batch + 1))
        assert qo[-1] == q.shape[0], f"planned for {qo[-1]} query rows, got {q.shape[0]}"
        if out is None:
            out = torch.empty_like(q)
        # As FlashInfer's check_shape_dtype_device: a given ``out`` must match ``q`` exactly.
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        group = q.shape[1] // k_cache.shape[2]
        page_size = k_cache.shape[1]
        for b in range(batch):
            pages = self.indices[indptr[b] : indptr[b + 1]].to(torch.int64)
            kv_len = (len(pages) - 1) * page_size + last[b]
            k = k_cache[pages].flatten(0, 1)[:kv_len].float()
            v = v_cache[pages].flatten(0, 1)[:kv_len].float()
            qb = q[qo[b] : qo[b + 1]].float()
            n = qb.shape[0]
            # Query j sees KV 0 .. kv_len - n + j (aligned to the end), all if not causal.
            mask = torch.ones(n, kv_len, dtype=torch.bool)
            if self.causal:
                mask = mask.tril(kv_len - n)
            ob = F.scaled_dot_product_attention(
                qb.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
                v.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask, scale=self.scale)
            out[qo[b] : qo[b + 1]] = ob.transpose(0, 1).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend,
                         paged_kv_indptr_buffer, paged_kv_indices_buffer,
                         paged_kv_last_page_len_buffer)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             pos_encoding_mode: str = "NONE", sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, non_blocking: bool = True) -> None:
        assert pos_encoding_mode == "NONE" and num_qo_heads % num_kv_heads == 0
        self._plan_pages(indptr, indices, last_page_len, page_size, sm_scale, head_dim,
                         q_data_type, kv_data_type)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        assert not use_cuda_graph, "the executor runs prefill attention eagerly"
        super().__init__(float_workspace_buffer, kv_layout, False, backend)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, non_blocking: bool = True) -> None:
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == torch.int32
        assert len(qo_indptr) == len(paged_kv_indptr)
        self._plan_pages(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                         page_size, sm_scale, head_dim_qk, q_data_type, kv_data_type)
        self.qo_indptr, self.causal = qo_indptr.clone(), causal
