"""Ray Serve deployments for TreeSpark: the engine replica, the cluster controller and
the OpenAI-compatible HTTP ingress. They import the ``treespark`` library; the library
never imports them."""
