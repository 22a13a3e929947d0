"""How much the fake-CUDA route's attention path weighs: one OPT-1.3b-shaped attention (B 2, H 32, T 512,
head 64, fp16, padding mask), forward + backward, recorded on fake CUDA tensors, with SDPA's math path
(what a CPU build of torch takes for fake CUDA tensors) and with memory-efficient attention (what an
RTX 3090 takes for fp16 with a mask). Prints the peak of live tensor bytes and the bytes saved for
backward, per layer (MiB, tensor bytes: no allocator rounding).

    python -m studies.attention_path
"""

from __future__ import annotations



def main() -> None:
    from pytest_rlhfmem.simcuda import build as native

    native.load()
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytest_rlhfmem.fakecuda.recorder import FakeCudaRecorder
    from pytest_rlhfmem.memory.trace import ALLOC, FREE

    def peak(events, start: int) -> int:
        live: dict[int, int] = {}
        cur = top = 0
        for e in events[start:]:
            if e.action == ALLOC:
                live[e.addr] = e.size
                cur += e.size
                top = max(top, cur)
            elif e.action == FREE and e.addr in live:
                cur -= live.pop(e.addr)
        return top

    b, h, t, d = 2, 32, 512, 64
    for path in ("math", "efficient"):
        rec = FakeCudaRecorder()
        with FakeTensorMode():
            rec.start()
            q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))  # noqa: E501
            mask = torch.zeros(b, 1, t, t, device="cuda", dtype=torch.float16)
            n0 = len(rec.events)
            if path == "math":
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, mask.expand(b, h, t, t), True)[0]
            n1 = len(rec.events)
            made = sum(e.size for e in rec.events[n0:n1] if e.action == ALLOC)
            kept = made - sum(e.size for e in rec.events[n0:n1] if e.action == FREE) - out.untyped_storage().nbytes()
            out.sum().backward()
            rec.stop()
        print(f"{path:9s}: forward+backward peak {peak(rec.events, n0) / 2**20:7.1f} MiB, "
              f"forward allocations {made / 2**20:6.1f} MiB, kept for backward {kept / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
