"""The engine: requests, scheduler, controller, Token-Deposit, the engine loop and its executors."""
