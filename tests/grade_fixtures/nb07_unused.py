"""07.3: a right unused_names and the wrong ones, each with the hint it must get."""
import re


def _indices(message):
    return [int(i) for i in re.search(r"did not receive grad for rank \d+: ([\d ]+)", message).group(1).split()]


def good(model, message):
    names = [name for name, p in model.named_parameters() if p.requires_grad]  # what DDP reduces
    return [names[i] for i in _indices(message)]


def frozen_counted(model, message):
    names = [name for name, _ in model.named_parameters()]
    return [names[i] for i in _indices(message)]


def counts_from_one(model, message):
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return [names[i - 1] for i in _indices(message)]


def module_names(model, message):
    return list(dict.fromkeys(name.rsplit(".", 1)[0] for name in good(model, message)))


def first_index_only(model, message):
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return [names[int(re.search(r"did not receive grad for rank \d+: (\d+)", message).group(1))]]


MISTAKES = {
    "frozen parameters counted": (frozen_counted, "only the parameters that require grad"),
    "off by one": (counts_from_one, "off by one"),
    "module names": (module_names, "not the modules"),
    "first index only": (first_index_only, "map every index"),
}
