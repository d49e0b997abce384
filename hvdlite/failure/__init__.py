"""What happens when a rank fails, freezes or falls out of step, so that the others get an
error instead of a hang: ``liveness`` and ``sentinel`` find a lost peer, ``waiting`` waits on
rounds while watching for one, ``deadlock`` and ``stall`` name ranks out of step, and
``abort_on_error`` and ``exit_guard`` end the whole job with the cause printed once."""
