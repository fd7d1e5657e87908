/**
 * Type test (compiled by `npm run typecheck`, never run): payload types declared in graphile-worker's
 * `GraphileWorker.Tasks` reach `locks.exclusive`, `locks.addJob`, `locks.lockAvailable`, an exclusive task's
 * own methods and the preset's `key` functions. Each `@ts-expect-error` line must be an error, or the
 * compilation fails.
 */
import { WorkerPreset } from "graphile-worker";
import { LocksPreset, makeLocks, makeLocksFromPreset } from "../../src/index.js";

declare global {
  // eslint-disable-next-line @typescript-eslint/no-namespace -- graphile-worker's declaration merging
  namespace GraphileWorker {
    interface Tasks {
      charge_card: { userId: number; amount: number };
      send_welcome: { email: string };
    }
  }
}

const locks = makeLocks({ connectionString: "postgres://localhost/x" });

// locks.exclusive: the task's payload parameter comes from the declaration.
const chargeCard = locks.exclusive(
  "charge_card",
  async (payload) => {
    const cents: number = payload.amount;
    void cents;
  },
  { key: (p) => ({ userId: p.userId }), onConflict: "reschedule" },
);
// @ts-expect-error a wrong payload type for a declared task
locks.exclusive("charge_card", async (_payload: { userId: string }) => undefined);
locks.exclusive("charge_card", async () => undefined, {
  // @ts-expect-error the key function reads a member the payload does not have
  key: (p) => p.user,
});
// An undeclared task keeps the explicit type argument form.
const other = locks.exclusive<{ k: string }>("other_task", async (p) => void p.k);
void other;

// The wrapped task's own methods.
void chargeCard.addJob({ userId: 1, amount: 5 });
// @ts-expect-error amount is missing
void chargeCard.addJob({ userId: 1 });
void chargeCard.lockAvailable({ userId: 1, amount: 0 });

// locks.addJob and locks.lockAvailable by identifier.
void locks.addJob("charge_card", { userId: 1, amount: 5 });
// @ts-expect-error userId must be a number
void locks.addJob("charge_card", { userId: "1", amount: 5 });
void locks.addJob("send_welcome", { email: "a@example.com" });
// @ts-expect-error send_welcome takes an email
void locks.addJob("send_welcome", { userId: 1 });
void locks.lockAvailable("charge_card", { userId: 1, amount: 0 });
// @ts-expect-error a wrong payload for lockAvailable
void locks.lockAvailable("charge_card", { id: 1 });
// Undeclared tasks take any payload, as before.
void locks.addJob("anything", { whatever: true });
const dynamicName: string = "charge_card";
void locks.addJob(dynamicName, 42);

// The preset: `key` functions see the declared payload.
const preset: GraphileConfig.Preset = {
  extends: [WorkerPreset, LocksPreset],
  worker: {
    locks: {
      tasks: {
        charge_card: {
          onConflict: "reschedule",
          supersede: true,
          key: (p) => ({ userId: p.userId }),
        },
        send_welcome: { unique: "queued", uniqueKey: (p) => p.email.toLowerCase() },
        undeclared: { key: (p: { region: string }) => p.region },
      },
    },
  },
};
const wrongKey: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error charge_card's payload has no email
        charge_card: { key: (p) => p.email },
      },
    },
  },
};
const wrongOption: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error not a conflict strategy
        charge_card: { onConflict: "later" },
      },
    },
  },
};
const wrongSupersede: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error supersede is a boolean
        charge_card: { onConflict: "reschedule", supersede: "yes" },
      },
    },
  },
};
// `enqueueRate` and `debounce` key functions see the declared payload too.
const limitedPreset: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        charge_card: { enqueueRate: { limit: 100, period: 60_000, key: (p) => p.userId } },
        send_welcome: { debounce: { delay: 5000, maxWait: 60_000, key: (p) => p.email } },
      },
    },
  },
};
const wrongDebounceKey: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error send_welcome's payload has no userId
        send_welcome: { debounce: { delay: 5000, maxWait: 60_000, key: (p) => p.userId } },
      },
    },
  },
};
// Per enqueue.
void locks.addJob("charge_card", { userId: 1, amount: 5 }, { supersede: true });
void makeLocksFromPreset(preset);
void limitedPreset;
void wrongDebounceKey;
void wrongKey;
void wrongOption;

// Composed limits: each limit's key function sees the declared payload, in code and in the preset.
locks.exclusive("charge_card", async () => undefined, {
  lockGroup: "card",
  limits: [
    { key: (p) => p.userId, limit: (userId: number) => (userId > 100 ? 2 : 1) },
    { key: () => "all", limit: 10, group: "payments" },
  ],
});
locks.exclusive("charge_card", async () => undefined, {
  // @ts-expect-error a limit's key function reads a member the payload does not have
  limits: [{ key: (p) => p.email }],
});
void locks.canStart("charge_card", { userId: 1, amount: 0 });
// @ts-expect-error a wrong payload for canStart
void locks.canStart("charge_card", { id: 1 });
const limitsPreset: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        charge_card: { lockGroup: "card", limits: [{ key: (p) => p.userId }, { group: "all" }] },
      },
    },
  },
};
// `rate.key` sees the declared payload too.
const rated: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        charge_card: { lock: false, rate: { limit: 100, period: 60_000, key: (p) => p.userId } },
      },
    },
  },
};
const wrongLimitKey: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error a limit's key function sees charge_card's payload, which has no email
        charge_card: { limits: [{ key: (p) => p.email }] },
      },
    },
  },
};
const wrongRateKey: GraphileConfig.Preset = {
  worker: {
    locks: {
      tasks: {
        // @ts-expect-error charge_card's payload has no email
        charge_card: { rate: { limit: 100, period: 60_000, key: (p) => p.email } },
      },
    },
  },
};
void limitsPreset;
void wrongLimitKey;
void wrongSupersede;
void rated;
void wrongRateKey;
