"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), with token authentication on."""

import contextlib
import os
import secrets

AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


@contextlib.contextmanager
def token_cluster(head: dict, nodes: list[dict]):
    """Starts a head with `head`'s arguments and one node per entry of `nodes`, under a fresh token; yields
    (cluster, node handles); shuts it down and restores the environment's authentication settings."""
    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in AUTH}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    reset_auth_token_state()
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        handles = [cluster.add_node(**node) for node in nodes]
        cluster.wait_for_nodes()
        yield cluster, handles
    finally:
        cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_auth_token_state()
