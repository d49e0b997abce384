import torch, torch.distributed as dist
dist.init_process_group("gloo")
bad=[]
for dt in [torch.int8,torch.uint8,torch.int16,torch.uint16,torch.int32,torch.uint32,torch.int64,torch.uint64,torch.float16,torch.bfloat16,torch.float32,torch.float64,torch.complex64,torch.complex128,torch.bool]:
    for op in ["SUM","MIN","MAX","PRODUCT"]:
        try:
            t=torch.ones(3,dtype=dt); dist.all_reduce(t,op=getattr(dist.ReduceOp,op))
        except Exception as e: bad.append((str(dt),op,str(e)[:40]))
    for name, fn in [("bcast", lambda t: dist.broadcast(t,0)), ("gather", lambda t: dist.all_gather([torch.empty_like(t) for _ in range(2)], t))]:
        try: fn(torch.ones(3,dtype=dt))
        except Exception as e: bad.append((str(dt),name,str(e)[:40]))
if dist.get_rank()==0:
    for b in bad: print(b)
