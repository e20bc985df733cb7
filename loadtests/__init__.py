"""Load experiments for TreeSpark Serve: Locust users, load shapes, the experiment
runner, its report, and a discrete-event serving simulator."""
