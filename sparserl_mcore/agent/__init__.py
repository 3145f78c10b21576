"""Multi-turn, tool-using episodes (docs/agents.md): the Env contract, rendering, append-only
trajectories and the episode runner."""

from sparserl_mcore.agent.env import ENVS, Env, EnvConfig, Reply, Turn, resolve_env

__all__ = ["ENVS", "Env", "EnvConfig", "Reply", "Turn", "resolve_env"]
