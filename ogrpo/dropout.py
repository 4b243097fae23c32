"""Whether a model draws random numbers in a training-mode forward: a dropout module with p > 0, or a config
dropout (attention dropout is applied functionally, with no module to find). Where it does, two forwards of the
same rows give different numbers, so no layer that answers one forward with another's (the per-group passes, the
old policy from the loss forward, groups trained ahead) can be exact."""

from __future__ import annotations


def draws_dropout(model) -> bool:
    import torch

    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return any("dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               for k, v in items)
