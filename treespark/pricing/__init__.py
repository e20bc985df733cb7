"""Pricing speculation: the control plane's maths, importable without torch.

* ``costmodel``   the verify-forward cost T(bs, k), acceptance per tree size, and the
                  price of one draft node under load (``plan_budget``);
* ``policy``      ``LoadSnapshot`` and the policies mapping it to a replica's ``Budget``;
* ``estimators``  what the controller learns online from heartbeats (calibration refit,
                  acceptance window, drafting cost).

numpy and the standard library only: the cluster controller and the HTTP ingress run
these in processes that never load a model.
"""
