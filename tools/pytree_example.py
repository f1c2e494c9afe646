"""Flatten a nested input the way ORTModule does, print what the schema records, rebuild it.

python tools/pytree_example.py
"""

from __future__ import annotations

import torch

import ortmodule_pytree


def main() -> None:
    inputs = {
        "input_ids": torch.randint(0, 100, (2, 8)),
        "attention_mask": torch.ones(2, 8, dtype=torch.bool),
        "past": [(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))],
        "use_cache": False,
    }
    tensors, schema = ortmodule_pytree.flatten(inputs)
    print(f"{schema.num_tensors} tensors:")
    for spec, tensor in zip(schema.tensor_specs, tensors, strict=True):
        print(f"  {spec.name:<22} {str(spec.dtype):<14} shape={tuple(tensor.shape)}")
    print(schema)

    rebuilt = ortmodule_pytree.unflatten(tensors, schema)
    assert rebuilt.keys() == inputs.keys() and rebuilt["input_ids"] is inputs["input_ids"]
    print("unflatten gave back the same structure and tensors")

    longer = {**inputs, "input_ids": torch.randint(0, 100, (4, 16))}
    _, same = ortmodule_pytree.flatten(longer)
    print(f"new batch and sequence length, same schema: {same == schema}")
    _, flipped = ortmodule_pytree.flatten({**inputs, "use_cache": True})
    print(f"re-export: {ortmodule_pytree.describe_difference(schema, flipped)}")


if __name__ == "__main__":
    main()
