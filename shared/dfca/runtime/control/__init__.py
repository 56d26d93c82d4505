"""The topology service's control plane: experiments, graphs, and what workers are told."""
