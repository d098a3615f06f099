"""Which train-thread stacks wait on a collective (``worker_group/stuck.py``, no Ray): the
controller replaces a gloo rank still there a few seconds after its abort."""

from raylastic._internal.worker_group.stuck import in_collective_wait

# The innermost frames of the two survivors replaced on 2026-12-07 (event log "stuck_at").
FSDP2 = '''  File "/venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 119, in __call__
    return dist.all_gather_single(
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
    return func(*args, **kwargs)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4394, in all_gather_single
    work.wait()
'''
DEEPSPEED = '''  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 820, in wait
    handle.wait(handle_dependency=handle_dependency)
  File "/venv/lib/python3.11/site-packages/deepspeed/utils/nvtx.py", line 33, in wrapped_fn
    ret_val = func(*args, **kwargs)
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 765, in wait
    instrument_w_nvtx(self.allgather_handle.wait)()
  File "/venv/lib/python3.11/site-packages/deepspeed/utils/nvtx.py", line 33, in wrapped_fn
    ret_val = func(*args, **kwargs)
'''
RECV = '''  File "/venv/lib/python3.11/site-packages/raylastic/testing/train_funcs.py", line 64, in ddp_regression
    dist.recv(torch.zeros(1), src=1, group=side)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2540, in recv
    pg.recv([tensor], group_src, tag).wait()
'''
# Not collectives: its own code, the lean optimizer hook, a forward pass.
OWN_CODE = '''  File "/venv/lib/python3.11/site-packages/raylastic/testing/train_funcs.py", line 261, in _maybe_hang
    time.sleep(0.5)
'''
LEAN_HOOK = '''  File "/venv/lib/python3.11/site-packages/torch/optim/optimizer.py", line 500, in wrapper
    result = pre_hook(self, args, kwargs)
  File "/venv/lib/python3.11/site-packages/raylastic/_internal/snapshots/sharded/lean.py", line 160, in wait
    while not self.released.wait(0.05):
'''
FORWARD = '''  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125, in forward
    return F.linear(input, self.weight, self.bias)
'''


def test_collective_waits_are_told_from_a_train_function_busy_elsewhere():
    assert in_collective_wait(FSDP2) and in_collective_wait(DEEPSPEED) and in_collective_wait(RECV)
    assert not any(in_collective_wait(s) for s in (OWN_CODE, LEAN_HOOK, FORWARD, ""))
    # only the innermost two frames count: a wait further out is already over
    assert not in_collective_wait(FSDP2 + FORWARD + OWN_CODE)
