/**
 * A TCP proxy on loopback that can be frozen: while frozen it forwards no bytes in either direction and
 * closes nothing (a side's close is passed on after the thaw), as a network partition looks to both ends.
 * Bytes that arrive meanwhile are held and delivered, in order, when it thaws.
 */
import { createServer, connect, type AddressInfo, type Socket } from "node:net";

export interface FreezableProxy {
  /** The port it listens on (127.0.0.1). */
  readonly port: number;
  freeze(): void;
  thaw(): void;
  close(): Promise<void>;
}

export async function startProxy(targetPort: number): Promise<FreezableProxy> {
  let frozen = false;
  const held: Array<() => void> = [];
  const sockets = new Set<Socket>();
  const later = (action: () => void): void => {
    if (frozen) held.push(action);
    else action();
  };
  const server = createServer((client) => {
    const upstream = connect(targetPort, "127.0.0.1");
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on("close", () => sockets.delete(socket));
      socket.on("error", () => undefined);
    }
    const pipe = (from: Socket, to: Socket): void => {
      from.on("data", (chunk) => later(() => to.write(chunk)));
      from.on("end", () => later(() => to.end()));
      from.on("close", () => later(() => to.destroy()));
    };
    pipe(client, upstream);
    pipe(upstream, client);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    port: (server.address() as AddressInfo).port,
    freeze() {
      frozen = true;
    },
    thaw() {
      frozen = false;
      for (const action of held.splice(0)) action();
    },
    async close() {
      frozen = false;
      held.length = 0;
      for (const socket of sockets) socket.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
