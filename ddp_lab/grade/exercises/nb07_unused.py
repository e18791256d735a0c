"""07.3: DDP's unused-parameter indices mapped to parameter names; graded in the kernel.

DDP's plain error lists "Parameter indices which did not receive grad for rank R: I J ...". The
indices count only the parameters DDP reduces: those of model.parameters() that require grad, in
that order, so a frozen layer shifts every index after it. The grader builds each model, knows
which of its parameters go unused, and writes DDP's message for them in the text DDP prints
(MESSAGE: what torch 2.14 printed on rank 1 of a 2-rank gloo run of a model whose first layer
was frozen and whose last head went unused: indices 4 5, after the 2 frozen parameters).
"""
from ddp_lab.grade.core import Exercise, error_text, register

MESSAGE = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error "
    "indicates that your module has parameters that were not used in producing loss. You can enable unused "
    "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
    "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs "
    "participate in calculating loss. \nIf you already have done the above, then the distributed data parallel "
    "module wasn't able to locate the output tensors in the return value of your module's `forward` function. "
    "Please include the loss function and the structure of the return value of `forward` of your module when "
    "reporting this issue (e.g. list, dict, iterable).\nParameter indices which did not receive grad for rank "
    "{rank}: {indices}\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either "
    "INFO or DETAIL to print out information about which particular parameters did not receive gradient on "
    "this rank as part of this error")


def _cases():
    """[(case, model, rank, names DDP did not get a gradient for)], models built here."""
    from torch import nn
    from ddp_lab.lessons.troubleshooting import TwoHeads
    frozen_body = TwoHeads()
    frozen_body.body.requires_grad_(False)  # fine-tuning the heads only
    experts = nn.ModuleDict({"proj": nn.Linear(10, 8), "gate": nn.Linear(8, 3),
                             "experts": nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), "out": nn.Linear(8, 2)})
    experts.proj.requires_grad_(False)  # a frozen pretrained input layer; experts 0 and 2 got no token
    return [("TwoHeads, aux unused", TwoHeads(), 0, ["aux.weight", "aux.bias"]),
            ("TwoHeads with its body frozen, aux unused", frozen_body, 1, ["aux.weight", "aux.bias"]),
            ("experts 0 and 2 unused, input layer frozen", experts, 1,
             ["experts.0.weight", "experts.0.bias", "experts.2.weight", "experts.2.bias"])]


def _message(model, rank, unused):
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return MESSAGE.format(rank=rank, indices=" ".join(str(trainable.index(n)) for n in unused))


def on_rank(answer, rank, world):
    obs = {}
    for case, model, r, unused in _cases():
        try:
            obs[case] = {"got": [str(n) for n in answer(model, _message(model, r, unused))]}
        except Exception as exc:
            obs[case] = {"error": error_text(exc)}
    return obs


def _mistake(model, unused, got):
    """The hint for the typical mistake that gives `got`, or None."""
    every = [n for n, _ in model.named_parameters()]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    idx = [trainable.index(n) for n in unused]
    modules = {n.rsplit(".", 1)[0] for n in unused}
    mistakes = [
        ([every[i] for i in idx], "DDP numbers only the parameters that require grad (frozen ones are not in "
                                  "its reducer): index [n for n, p in model.named_parameters() if p.requires_grad]"),
        ([trainable[i - 1] for i in idx], "off by one: DDP's indices count from 0, like a Python list"),
        ([trainable[i + 1] for i in idx if i + 1 < len(trainable)], "off by one: DDP's indices count from 0, "
                                                                    "like a Python list"),
        (unused[:1], "the message lists several indices: map every index, not only the first"),
    ]
    if got and set(got) <= modules:
        return "return parameter names (aux.weight, as named_parameters() gives them), not the modules that hold them"
    return next((hint for names, hint in mistakes if sorted(got) == sorted(names)), None)


def judge(per_rank):
    obs, problems = per_rank[0], []
    for case, model, _, unused in _cases():
        o = obs[case]
        if "error" in o:
            index = "IndexError" in o["error"]
            problems.append(f"{case}: your function raised {o['error']}" + (
                ": an index past the end of the list; DDP's indices count from 0, over the parameters that "
                "require grad" if index else ""))
        elif sorted(o["got"]) != sorted(unused):
            hint = _mistake(model, unused, o["got"])
            problems.append(f"{case}: you returned {o['got']}, DDP meant {unused}" + (f": {hint}" if hint else ""))
    return problems


register(Exercise(
    id="07.3", notebook="07_troubleshooting", title="Unused-parameter indices to names",
    skills="DDP's index counts the parameters that require grad, from 0; parameter, not module, names",
    answer="unused_names(model, message) -> names of the parameters DDP's error lists by index",
    nproc=0, on_rank=on_rank, judge=judge))
