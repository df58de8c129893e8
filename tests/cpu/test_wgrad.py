"""moe_sft/kernels/wgrad.py on CPU: the side-stream guard of megatron's bucket reductions (the
kernel and its overlap run on CUDA only: tests/gpu/test_gpu_wgrad.py, tests/gpu/test_gpu_parity.py)."""


def test_bucket_reductions_wait_for_the_side_stream_once_guarded(monkeypatch):
    """Under overlap_grad_reduce megatron starts a bucket's reduction during backward: the guard
    makes the start wait for the experts' side-stream gradient additions first (installed once)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from moe_sft.kernels import wgrad

    calls = []
    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_grad_sync", lambda self, *a, **k: calls.append("start"))
    monkeypatch.setattr(wgrad, "wait_for_side_streams", lambda: calls.append("wait"))
    wgrad.guard_grad_sync()
    wgrad.guard_grad_sync()
    _ParamAndGradBucketGroup.start_grad_sync(object())
    assert calls == ["wait", "start"]
