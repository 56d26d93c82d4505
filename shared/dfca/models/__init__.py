"""Models batched over clients: parameters carry a leading client (or client x cluster) dimension.

- `batched`: the interface (BatchedModel) and sample orders; `mlp`: the hand-written MLP; `paper_cnn`: the paper's CNN;
- `torch_model`: any torch module trained every client at once through torch.func; `factory`: a user's module factory;
- `build`: the model a config names.
"""
