"""A new attention method in one file: docs/architecture.md's "Adding a method", runnable.

``Mine`` is a toy (softmax over the first ``keep`` keys). Registering its spec is all it takes
for the library and the tools to know it: ``effattn.attention(..., method="mine")``,
``effattn.build``, ``effattn.nn.MultiheadAttention(..., method="mine")``, ``effattn methods``,
``effattn bench --methods mine`` (the tools see it when the module defining it is imported, e.g.
from a package of your own). Below the definition, ``main`` uses it and checks it against its
dense reference.

    python examples/custom_method.py             # a second or two
    python examples/custom_method.py --length 64

The block between the markers is the documentation's example, verbatim (tests/test_examples.py
checks that they agree).
"""

# --- docs/architecture.md, "Adding a method" ---
import torch.nn.functional as F

from effattn.base import AttentionMethod, check_positive_int
from effattn.registry import Budget, MethodSpec, Problem, register


class Mine(AttentionMethod):
    """Softmax over the first `keep` keys (a toy): softmax(scale q_i K[:keep]^T) V[:keep]."""

    def __init__(self, head_dim, heads, max_len=None, seed=None, scale=None, *, keep):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.keep = check_positive_int("keep", keep)

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        keep = self.keep
        return F.scaled_dot_product_attention(q, k[:, :, :keep], v[:, :, :keep], scale=self.scale)


def _reference(module, q, k, v, *, causal=False, key_padding_mask=None):
    from effattn import naive  # imported here: the references stay off the runtime path

    keep = module.keep
    return naive.softmax_attention(q, k[:, :, :keep], v[:, :, :keep], scale=module.scale)


def _flops(options, p: Problem) -> float:
    return 2.0 * p.batch * p.heads * p.n * min(options["keep"], p.m) * (p.head_dim + p.value_dim)


register(
    MethodSpec(
        name="mine", summary="softmax over a prefix of the keys", paper="-",
        complexity="O(N keep D)", causal=False, padding_mask=False, cross=True, decoding=False,
        options={"keep": 64},
        refusals={"causal": "...", "padding_mask": "...", "decoding": "...",
                  "sequence_parallel": "..."},
        flops=_flops, budget=Budget("keep", (16, 64, 256)), reference=_reference,
    ),
    Mine,
)
# --- end of the documentation's example ---


def main() -> None:
    import argparse

    import torch

    import effattn
    from effattn.nn import MultiheadAttention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=256, help="sequence length N (default 256)")
    p.add_argument("--keep", type=int, default=16, help="keys kept (default 16)")
    args = p.parse_args()

    print("registered:", "mine" in effattn.methods(), "|", effattn.spec("mine").summary)
    q, k, v = torch.randn(3, 2, 4, args.length, 32, dtype=torch.float64).unbind(0)
    out = effattn.attention(q, k, v, method="mine", keep=args.keep)
    attn = effattn.build("mine", head_dim=32, heads=4, keep=args.keep).double()
    reference = effattn.spec("mine").reference(attn, q, k, v)
    print(f"output {tuple(out.shape)}; largest difference from the dense reference "
          f"{(attn(q, k, v) - reference).abs().max().item():.1e}")
    try:
        effattn.attention(q, k, v, method="mine", causal=True)
    except ValueError as error:
        print("causal is refused:", error)
    layer = MultiheadAttention(64, 4, method="mine", keep=args.keep, batch_first=True)
    x = torch.randn(2, args.length, 64)
    print("in nn.MultiheadAttention:", tuple(layer(x, x, x)[0].shape))


if __name__ == "__main__":
    main()
