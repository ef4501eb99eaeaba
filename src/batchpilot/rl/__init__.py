"""Training the PPO batch-size policy in the simulator (stable-baselines3, the optional extra ``rl``) and exporting
it to the plain torch MLP that :class:`~batchpilot.controllers.ppo.PPOController` runs. Nothing here is imported by
``import batchpilot``; stable-baselines3 and gymnasium are imported only inside the functions that need them."""
